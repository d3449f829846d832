"""Tiny random vision-language models and their processors, built entirely in code (no downloads).

For the tests of image inputs: :func:`tiny_vlm` gives, per architecture in :data:`ARCHS`, a model of the class
``AutoModelForImageTextToText`` maps its type to, built with ``from_config`` from a tiny config that keeps the
real config's structure (sub-configs, per-layer lists, every layer kind), and the model's own processor class
built from its (PIL/numpy) image processor class, a byte-level tokenizer (:func:`acb.models.build_tokenizer`)
plus the special tokens the model needs, and a small chat template that writes each image part as the model's
own placeholder string. No video processor is built (transformers' video processors need torchvision).

The weights are random: the text is meaningless, but the images do change the greedy tokens, so the tests can
tell whether an image reached the model. :data:`FACTS` records, per architecture, what the installed
transformers does with images (placeholder ids and counts, the processor outputs, attention and position
quirks), found by reading its source and by running these models.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any
from unittest import mock

import numpy as np
import torch

from acb.models import build_tokenizer

if TYPE_CHECKING:
    from PIL.Image import Image
    from transformers import PreTrainedTokenizerFast

ARCHS: tuple[str, ...] = ("qwen3_vl", "qwen3_5", "gemma3", "llava_onevision", "idefics3", "internvl", "llava")

IMAGE_SIZE = (64, 64)  # (width, height) of the test images
INIT_RANGE = 0.2  # wide init: peaked logits, and image features as large as the token embeddings

# the text model's shape, shared by every architecture (its own fields are added per architecture)
_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=INIT_RANGE,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# a small vision tower (ViT-like ones; the Qwen towers name their fields differently)
_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    initializer_range=INIT_RANGE,
)


def image(seed: int, size: tuple[int, int] = IMAGE_SIZE) -> Image:
    """A random RGB image of ``size`` (width, height), the same for the same seed."""
    from PIL import Image as PILImage

    width, height = size
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return PILImage.fromarray(pixels)  # uint8 (height, width, 3): RGB


def messages(images: list, text: str) -> list[dict]:
    """One user chat message: the images (as ``image`` content parts), then the text."""
    content: list[dict] = [{"type": "image", "image": img} for img in images]
    content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


def _chat_template(image_placeholder: str) -> str:
    """``role: content`` lines, text parts verbatim and each image part as ``image_placeholder``."""
    return (
        "{% for m in messages %}{{ m['role'] }}: "
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
        f"{{% if p['type'] == 'image' %}}{{{{ {image_placeholder!r} }}}}"
        "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
        "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )


def _tokenizer(named: dict[str, str], extra: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """:func:`acb.models.build_tokenizer`'s byte-level vocabulary plus special tokens: ``named`` ones become
    tokenizer attributes (``tok.image_token``, ``tok.image_token_id``...), ``extra`` ones are just added."""
    from transformers import PreTrainedTokenizerFast

    base = build_tokenizer()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        extra_special_tokens=dict(named),
    )
    if extra:
        tok.add_tokens(list(extra), special_tokens=True)
    return tok


def _processor(cls: type, **kwargs: Any) -> Any:
    """``cls(**kwargs)``, letting sub-processors be ``None`` (the video processor: without torchvision
    transformers cannot even name its base class, so its type check fails)."""
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def lenient(self: Any, name: str, arg: Any) -> Any:
        return None if arg is None else check(self, name, arg)

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lenient):
        return cls(**kwargs)


def _qwen_vl(arch: str) -> tuple[Any, Any]:
    from transformers import AutoConfig, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = _tokenizer(
        {
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_start_token": "<|vision_start|>",
            "vision_end_token": "<|vision_end|>",
        }
    )
    patch, merge = 8, 2
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=patch,
        temporal_patch_size=2,
        spatial_merge_size=merge,
        out_hidden_size=_TEXT["hidden_size"],
        num_position_embeddings=64,  # an 8x8 grid of learned positions, interpolated to each image's grid
        initializer_range=INIT_RANGE,
    )
    text = dict(_TEXT, vocab_size=len(tok))
    if arch == "qwen3_vl":
        vision["deepstack_visual_indexes"] = [0]
        # head_dim 16: 8 rotary frequencies, split T/H/W as the real [24, 20, 20] splits 64
        text.update(
            head_dim=16,
            rope_parameters=dict(rope_type="default", rope_theta=5e5, mrope_section=[4, 2, 2], mrope_interleaved=True),
        )
    else:
        # Qwen3.5: gated-delta-rule (linear attention) and full-attention layers; partial rotary (1/4 of head_dim)
        text.update(
            head_dim=32,
            layer_types=["linear_attention", "full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=1e7,
                partial_rotary_factor=0.25,
                mrope_section=[2, 1, 1],
                mrope_interleaved=True,
            ),
        )
    config = AutoConfig.for_model(
        arch,
        text_config=text,
        vision_config=vision,
        image_token_id=tok.image_token_id,
        video_token_id=tok.video_token_id,
        vision_start_token_id=tok.vision_start_token_id,
        vision_end_token_id=tok.vision_end_token_id,
    )
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch,
        temporal_patch_size=2,
        merge_size=merge,
        min_pixels=(2 * patch * merge) ** 2,
        max_pixels=(8 * patch * merge) ** 2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor = _processor(
        Qwen3VLProcessor,
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=None,
        chat_template=_chat_template("<|vision_start|><|image_pad|><|vision_end|>"),
    )
    return config, processor


def _gemma3() -> tuple[Any, Any]:
    from transformers import Gemma3Config, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = _tokenizer(
        {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    )
    image_size, patch, tokens_per_image = 32, 4, 16  # 8x8 patches, average-pooled to 4x4
    config = Gemma3Config(
        text_config=dict(
            _TEXT,
            vocab_size=len(tok),
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=32,  # twice an image: the real ratio is 1024 to 256
            layer_types=["sliding_attention", "full_attention"],
        ),
        vision_config=dict(_VISION, image_size=image_size, patch_size=patch),
        mm_tokens_per_image=tokens_per_image,
        boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id,
        image_token_index=tok.image_token_id,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,  # tied, a random model mostly repeats its last token
    )
    image_processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=_chat_template("<start_of_image>"),
        image_seq_length=tokens_per_image,
    )
    return config, processor


def _llava_onevision() -> tuple[Any, Any]:
    from transformers import LlavaOnevisionConfig, LlavaOnevisionProcessor
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    tok = _tokenizer({"image_token": "<image>", "video_token": "<video>"})
    tile, patch = 24, 8  # a 3x3 grid of patches per tile
    pinpoints = [[tile, tile], [tile, 2 * tile], [2 * tile, tile], [2 * tile, 2 * tile]]
    config = LlavaOnevisionConfig(
        text_config=dict(_TEXT, model_type="qwen2", vocab_size=len(tok)),
        vision_config=dict(_VISION, model_type="siglip_vision_model", image_size=tile, patch_size=patch),
        image_token_index=tok.image_token_id,
        video_token_index=tok.video_token_id,
        image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
    )
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": tile, "width": tile}, image_grid_pinpoints=pinpoints
    )
    processor = _processor(
        LlavaOnevisionProcessor,
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=None,
        num_image_tokens=(tile // patch) ** 2,
        vision_feature_select_strategy="full",
        chat_template=_chat_template("<image>"),
    )
    return config, processor


def _llava() -> tuple[Any, Any]:
    from transformers import LlavaConfig, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tok = _tokenizer({"image_token": "<image>"})
    image_size, patch = 32, 8  # 16 patches (+ CLS, dropped by the "default" feature strategy)
    config = LlavaConfig(
        text_config=dict(_TEXT, model_type="llama", vocab_size=len(tok)),
        vision_config=dict(
            _VISION, model_type="clip_vision_model", image_size=image_size, patch_size=patch, projection_dim=32
        ),
        image_token_index=tok.image_token_id,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
    )
    image_processor = LlavaImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=_chat_template("<image>"),
    )
    return config, processor


def _idefics3() -> tuple[Any, Any]:
    from transformers import Idefics3Config, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    row_col = tuple(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6))
    tok = _tokenizer(
        {"image_token": "<image>"},
        extra=("<fake_token_around_image>", "<end_of_utterance>", "<global-img>", *row_col),
    )
    tile, patch, scale = 32, 8, 2  # 4x4 patches per tile, pixel-shuffled to 2x2 = 4 tokens
    config = Idefics3Config(
        text_config=dict(_TEXT, model_type="llama", vocab_size=len(tok)),
        vision_config=dict(_VISION, image_size=tile, patch_size=patch),
        image_token_id=tok.image_token_id,
        scale_factor=scale,
    )
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * tile}, max_image_size={"longest_edge": tile}, do_image_splitting=True
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        image_seq_len=(tile // patch) ** 2 // scale**2,
        chat_template=_chat_template("<image>"),
    )
    return config, processor


def _internvl() -> tuple[Any, Any]:
    from transformers import InternVLConfig, InternVLProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    tok = _tokenizer(
        {
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        }
    )
    tile, patch = 32, 8  # 4x4 patches per tile, pixel-shuffled (downsample 0.5) to 2x2 = 4 tokens
    tokens_per_tile = (tile // patch) ** 2 // 4
    config = InternVLConfig(
        text_config=dict(_TEXT, model_type="qwen2", vocab_size=len(tok)),
        vision_config=dict(_VISION, image_size=[tile, tile], patch_size=[patch, patch]),
        image_token_id=tok.context_image_token_id,
        image_seq_length=tokens_per_tile,
        downsample_ratio=0.5,
    )
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": tile, "width": tile}, crop_to_patches=True, min_patches=1, max_patches=4
    )
    processor = _processor(
        InternVLProcessor,
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=None,
        image_seq_length=tokens_per_tile,
        chat_template=_chat_template("<IMG_CONTEXT>\n"),
    )
    return config, processor


def _gemma4(bidirectional: str | None, per_layer: bool = False) -> tuple[Any, Any]:
    """Gemma 4's conditional model, its text config a 26B-A4B's in small (sliding and full layers,
    the full ones K=V with one wider KV head, an MoE block in every layer), with
    ``use_bidirectional_attention=bidirectional`` (None: causal; "vision": an image's tokens see
    each other both ways on the sliding layers). ``per_layer``: an E2B/E4B's instead (per-layer
    inputs, ``hidden_size_per_layer_input`` 8, and the last two layers reading earlier layers' K/V;
    dense, separate K and V)."""
    from transformers import Gemma4Config, Gemma4Processor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    # (the processor needs the audio tokens, and the config the video and audio token ids)
    tok = _tokenizer(
        {
            "boi_token": "<|image>",
            "eoi_token": "<image|>",
            "image_token": "<|image|>",
            "boa_token": "<|audio>",
            "eoa_token": "<audio|>",
            "audio_token": "<|audio|>",
        }
    )
    patch, pool, tokens = 4, 2, 70  # 70: the fewest soft tokens per image the processor supports
    image_processor = Gemma4ImageProcessorPil(patch_size=patch, pooling_kernel_size=pool, max_soft_tokens=tokens)
    processor = _processor(
        Gemma4Processor,
        feature_extractor=None,
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=None,
        chat_template=_chat_template("<|image|>"),
        image_seq_length=tokens,
    )
    text = dict(
        _TEXT,
        num_hidden_layers=6,
        vocab_size=len(tok),
        vocab_size_per_layer_input=len(tok),
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=8,  # shorter than an image: its tokens see their whole image ahead (not behind)
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        final_logit_softcapping=30.0,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        use_bidirectional_attention=bidirectional,
    )
    if per_layer:
        text.update(
            num_global_key_value_heads=None,
            attention_k_eq_v=False,
            enable_moe_block=False,
            num_experts=None,
            top_k_experts=None,
            moe_intermediate_size=None,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=8,
        )
    config = Gemma4Config(
        text_config=text,
        vision_config=dict(
            _VISION,
            num_key_value_heads=2,
            head_dim=16,
            patch_size=patch,
            pooling_kernel_size=pool,
            position_embedding_size=64,
        ),
        audio_config=None,
        image_token_id=tok.image_token_id,
        boi_token_id=tok.boi_token_id,
        eoi_token_id=tok.eoi_token_id,
        video_token_id=processor.video_token_id,
        audio_token_id=tok.audio_token_id,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
    )
    return config, processor


@functools.cache
def tiny_gemma4(bidirectional: str | None = None, per_layer: bool = False) -> tuple[torch.nn.Module, Any]:
    """A tiny random Gemma 4 conditional model (float32, eval mode) and its processor (see
    :func:`_gemma4`); the same weights for every ``bidirectional``. Cached, as :func:`tiny_vlm`."""
    from transformers import Gemma4ForConditionalGeneration

    config, processor = _gemma4(bidirectional, per_layer)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config)
    gen = model.generation_config
    gen.do_sample = False
    gen.eos_token_id = None
    gen.pad_token_id = 0
    return model.eval(), processor


@functools.cache
def tiny_paligemma() -> tuple[torch.nn.Module, Any]:
    """A tiny random PaliGemma (a Gemma text model, SigLIP vision; float32, eval mode) and its
    processor. Its prompt is a prefix whose tokens, image and text, all see each other both ways
    (``token_type_ids`` 0 on the whole prompt: a prefix-LM); its config sets the text config's
    ``use_bidirectional_attention`` (True when unset)."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration, PaliGemmaProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    size, patch = 32, 8
    image_processor = SiglipImageProcessorPil(size={"height": size, "width": size})
    image_processor.image_seq_length = (size // patch) ** 2  # (a checkpoint's preprocessor config has it)
    processor = PaliGemmaProcessor(
        image_processor=image_processor,
        tokenizer=_tokenizer({"image_token": "<image>"}),
        chat_template=_chat_template("<image>"),
    )
    vocab = len(processor.tokenizer)
    config = PaliGemmaConfig(
        text_config=dict(_TEXT, model_type="gemma", vocab_size=vocab, head_dim=16),
        vision_config=dict(_VISION, model_type="siglip_vision_model", image_size=size, patch_size=patch),
        image_token_index=processor.image_token_id,
        projection_dim=_TEXT["hidden_size"],
        hidden_size=_TEXT["hidden_size"],
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration(config)
    gen = model.generation_config
    gen.do_sample, gen.eos_token_id, gen.pad_token_id = False, None, 0
    return model.eval(), processor


# Molmo2's special tokens in the tiny model (inside its vocabulary: acb checks prompt ids against the output
# vocabulary, and a real Molmo2's are past it, in its additional embeddings)
_MOLMO2_VOCAB = 320
_MOLMO2_START, _MOLMO2_END, _MOLMO2_PATCH, _MOLMO2_COL, _MOLMO2_LOW = range(300, 305)


@functools.cache
def tiny_molmo2() -> torch.nn.Module:
    """A tiny random Molmo2 (float32, eval mode). Its processor's image processor needs torchvision
    (not installed): :func:`molmo2_prompt` makes its outputs by hand. Its own forward puts every image
    token of a prompt in one block whose tokens see each other both ways (``mm_token_type_ids``)."""
    from transformers import Molmo2Config, Molmo2ForConditionalGeneration

    patch = 4
    head = dict(num_attention_heads=2, num_key_value_heads=2, head_dim=16, initializer_range=INIT_RANGE)
    config = Molmo2Config(
        text_config=dict(_TEXT, vocab_size=_MOLMO2_VOCAB, additional_vocab_size=0, head_dim=16),
        vision_config=dict(_VISION, **head, image_size=[4 * patch, 4 * patch], patch_size=patch),
        adapter_config=dict(
            **head, vision_feature_layer=[-1, -2], hidden_size=32, intermediate_size=64, text_hidden_size=64
        ),
        image_start_token_id=_MOLMO2_START,
        image_end_token_id=_MOLMO2_END,
        image_patch_id=_MOLMO2_PATCH,
        low_res_image_start_token_id=_MOLMO2_LOW,
        frame_start_token_id=305,
        frame_end_token_id=306,
        initializer_range=INIT_RANGE,
    )
    torch.manual_seed(0)
    model = Molmo2ForConditionalGeneration(config)
    gen = model.generation_config
    gen.do_sample, gen.eos_token_id, gen.pad_token_id = False, None, 0
    return model.eval()


def molmo2_prompt(seed: int, images: int, words: list[int]) -> dict[str, torch.Tensor]:
    """What Molmo2's processor makes of a prompt with ``images`` random images (16x16 pixels, a
    low-resolution crop and one tile of 4x4 patches, each pooled 2x2 to 2x2 tokens) between
    ``words``: per image, ``<low_res_im_start>``, two rows of two patches and a column token,
    ``<im_end><im_start>``, the same, ``<im_end>``: 14 tokens, all marked 1 in ``mm_token_type_ids``."""
    row = [_MOLMO2_PATCH, _MOLMO2_PATCH, _MOLMO2_COL]
    ids = [1, *words[:3]]
    for k in range(images):
        ids += [_MOLMO2_LOW, *row, *row, _MOLMO2_END, _MOLMO2_START, *row, *row, _MOLMO2_END, *words[3 + k : 5 + k]]
    ids += words[:4]
    t = torch.tensor([ids])
    grid = torch.arange(16).reshape(2, 2, 2, 2).permute(0, 2, 1, 3).reshape(4, 4)  # 2x2 pooling windows
    pooling = torch.cat([grid + 32 * k + 16 * crop for k in range(images) for crop in range(2)])
    return dict(
        input_ids=t,
        attention_mask=torch.ones_like(t),
        mm_token_type_ids=(t >= _MOLMO2_START).long(),
        pixel_values=torch.randn(2 * images, 16, 4 * 4 * 3, generator=torch.Generator().manual_seed(seed)),
        image_token_pooling=pooling,
        image_grids=torch.tensor([[2, 2, 2, 2]] * images),
        image_num_crops=torch.tensor([2] * images),
    )


_BUILDERS = {
    "qwen3_vl": functools.partial(_qwen_vl, "qwen3_vl"),
    "qwen3_5": functools.partial(_qwen_vl, "qwen3_5"),
    "gemma3": _gemma3,
    "llava_onevision": _llava_onevision,
    "idefics3": _idefics3,
    "internvl": _internvl,
    "llava": _llava,
}


@functools.cache
def tiny_vlm(arch: str) -> tuple[torch.nn.Module, Any]:
    """A tiny random ``arch`` vision-language model (float32, eval mode) and its processor.

    Cached: every caller shares the same pair, so don't change them.
    """
    from transformers import AutoModelForImageTextToText

    if arch not in _BUILDERS:
        raise ValueError(f"unknown tiny VLM architecture {arch!r}; choose from {ARCHS}")
    config, processor = _BUILDERS[arch]()
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        if arch == "gemma3":
            # Gemma 3 initializes its image projection to zeros, which would blank every image out
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=1.0)
        if arch == "qwen3_5":
            # the gated delta rule's decay rates init in [0.01, 16]: most heads forget the image within a token
            for layer in model.model.language_model.layers:
                if layer.block_type == "linear_attention":
                    a_log = layer.linear_attn.A_log
                    a_log.copy_(torch.empty_like(a_log).uniform_(0.01, 0.1).log())
    gen = model.generation_config
    gen.do_sample = False
    gen.eos_token_id = None
    gen.pad_token_id = 0
    return model.eval(), processor


# What the installed transformers (5.23) does with images, per architecture: read from its source
# (transformers/models/<arch>/) and checked on these models. Counts are for an IMAGE_SIZE (64x64) image.
_MROPE_NOTE = (
    "yes: M-RoPE. generate's _prepare_position_ids_for_generation calls model.model.get_rope_index(input_ids, "
    "mm_token_type_ids, image_grid_thw, attention_mask) and hands the language model position_ids of shape "
    "(4, batch, seq): row 0 the plain text positions 0..seq-1 (used for the causal mask), rows 1-3 the T/H/W "
    "rotary positions (an image's tokens all get T=start, H=start+row, W=start+col over the merged grid; the text "
    "after it resumes at start+max(h, w)); the rope deltas (max position + 1 - seq len, shape (batch, 1), -12 "
    "for one 64x64 image) are cached on model.model.rope_deltas and each decode step gets rows 1-3 = text "
    "position + rope_deltas. Without position_ids, the forward computes them itself (compute_3d_position_ids) "
    "and raises if pixel inputs come without mm_token_type_ids. The text rotary embedding interleaves the T/H/W "
    "frequencies by mrope_section (rope_parameters)."
)
FACTS: dict[str, dict] = {
    "qwen3_vl": dict(
        model_class="Qwen3VLForConditionalGeneration",
        processor_class="Qwen3VLProcessor (video_processor=None)",
        image_processor_class="Qwen2VLImageProcessorPil",
        image_token="<|image_pad|>",
        image_token_id=259,
        placeholder="<|vision_start|><|image_pad|><|vision_end|> (the processor repeats <|image_pad|>)",
        image_tokens=16,
        image_tokens_40x56=8,
        image_tokens_rule="image_grid_thw.prod() // merge_size**2: patches of 8 px, 2x2 merged; the image is "
        "resized to multiples of 16 px (smart_resize) within [min_pixels, max_pixels]",
        processor_outputs="input_ids, attention_mask, mm_token_type_ids (0 text, 1 image), pixel_values "
        "(all images' patches flattened: (num_patches, 3*2*8*8) = (64, 384)), image_grid_thw ((num_images, 3))",
        bidirectional_image_attention="no: the language model is causal throughout (only the vision tower's "
        "attention is non-causal, per image via cu_seqlens)",
        mrope=_MROPE_NOTE,
        get_image_features="model.model.get_image_features(pixel_values, image_grid_thw=None, **kwargs) -> "
        "BaseModelOutputWithDeepstackFeatures: pooler_output a tuple of one (n_tokens_i, hidden) tensor per image "
        "(torch.split), deepstack_features a list (per deepstack layer) of such tuples",
        language_model="model.model.language_model (Qwen3VLTextModel); vision tower model.model.visual",
        notes="DeepStack: features from the vision layers in deepstack_visual_indexes are added to the hidden "
        "states of the image positions after the first text layers (visual_pos_masks, deepstack_visual_embeds "
        "passed to the language model), so an image is more than its placeholder embeddings. vision_start/end "
        "tokens are text (mm_token_type_ids 0).",
    ),
    "qwen3_5": dict(
        model_class="Qwen3_5ForConditionalGeneration",
        processor_class="Qwen3VLProcessor (video_processor=None); AutoProcessor maps qwen3_5 to it",
        image_processor_class="Qwen2VLImageProcessorPil",
        image_token="<|image_pad|>",
        image_token_id=259,
        placeholder="<|vision_start|><|image_pad|><|vision_end|> (the processor repeats <|image_pad|>)",
        image_tokens=16,
        image_tokens_40x56=8,
        image_tokens_rule="as qwen3_vl",
        processor_outputs="input_ids, attention_mask, mm_token_type_ids, pixel_values, image_grid_thw",
        bidirectional_image_attention="no (causal full attention; the linear-attention layers are recurrent)",
        mrope=_MROPE_NOTE + " Qwen3.5 rotates only partial_rotary_factor (1/4) of head_dim.",
        get_image_features="model.model.get_image_features(pixel_values, image_grid_thw=None, **kwargs) -> "
        "BaseModelOutputWithPooling, pooler_output a tuple of one (n_tokens_i, hidden) tensor per image",
        language_model="model.model.language_model (Qwen3_5TextModel); vision tower model.model.visual",
        notes="text layers: layer_types ['linear_attention' (gated delta rule, Qwen3_5GatedDeltaNet, recurrent "
        "and conv state in the cache), 'full_attention' (gated output)]; no DeepStack. Without "
        "flash-linear-attention / causal-conv1d it falls back to the PyTorch reference kernels (warnings). The "
        "delta rule's decay rates (A_log) are re-drawn in [0.01, 0.1] here: their init range [0.01, 16] "
        "forgets an image within a token and the image barely changed the output.",
    ),
    "gemma3": dict(
        model_class="Gemma3ForConditionalGeneration",
        processor_class="Gemma3Processor",
        image_processor_class="Gemma3ImageProcessorPil",
        image_token="<image_soft_token>",
        image_token_id=261,
        placeholder="<start_of_image> (the boi token: the processor's image_token); the processor replaces it "
        "with '\\n\\n<start_of_image>' + <image_soft_token> * image_seq_length + '<end_of_image>\\n\\n'",
        image_tokens=16,
        image_tokens_40x56=16,
        image_tokens_rule="fixed mm_tokens_per_image (= processor image_seq_length): every image is resized to "
        "32x32 (8x8 patches of 4 px), average-pooled to 4x4",
        processor_outputs="input_ids, attention_mask, pixel_values ((num_images, 3, 32, 32)), token_type_ids "
        "(1 on the <image_soft_token> positions only; the processor renames mm_token_type_ids)",
        bidirectional_image_attention="yes: with token_type_ids the forward (and generate's "
        "create_masks_for_generate) builds block_sequence_ids (one id per run of consecutive image tokens, -1 "
        "for text): full-attention layers use OR(causal, same image block), sliding layers AND(sliding window, "
        "OR(causal, same block)); so an image token sees the later tokens of its own image, not the next image "
        "(boi/eoi stay causal). generate passes token_type_ids on the first (prefill) iteration only "
        "(prepare_inputs_for_generation sets it None when decoding with a cache). Dropping token_type_ids "
        "changes the logits.",
        mrope="no: plain 1-D positions (position_ids (batch, seq)); local and global rope thetas per layer type",
        get_image_features="model.model.get_image_features(pixel_values, **kwargs) -> BaseModelOutputWithPooling, "
        "pooler_output a (num_images, mm_tokens_per_image, hidden) tensor",
        language_model="model.model.language_model (Gemma3TextModel); vision tower model.model.vision_tower (SigLIP)",
        notes="text layer_types ['sliding_attention', 'full_attention'], sliding_window 32; the language model "
        "gets a dict of masks per layer type. The text embeddings are scaled by sqrt(hidden_size) "
        "(Gemma3TextScaledWordEmbedding); the image features are not. Gemma 3 initializes the image projection "
        "(multi_modal_projector.mm_input_projection_weight) to zeros: re-drawn here (std 1), or images do "
        "nothing. tie_word_embeddings=False here (tied, the random model repeats its last token).",
    ),
    "llava_onevision": dict(
        model_class="LlavaOnevisionForConditionalGeneration",
        processor_class="LlavaOnevisionProcessor (video_processor=None)",
        image_processor_class="LlavaOnevisionImageProcessorPil",
        image_token="<image>",
        image_token_id=259,
        placeholder="<image>",
        image_tokens=51,
        image_tokens_40x56=39,
        image_tokens_rule="one image in a sample: anyres: a 24x24 base tile (3x3 patches = 9 tokens) + the best "
        "pinpoint grid of tiles, unpadded to the aspect ratio, one image_newline token per row (64x64: 9 + 6*6 + 6 "
        "= 51). Several images in a sample: the base tile only + 1 newline = 10 tokens each (batch_num_images).",
        processor_outputs="input_ids, attention_mask, pixel_values ((num_images, max_tiles, 3, 24, 24), zero-padded "
        "tiles), image_sizes ((num_images, 2) original h, w), batch_num_images ((batch,))",
        bidirectional_image_attention="no (causal)",
        mrope="no: 1-D positions",
        get_image_features="model.model.get_image_features(pixel_values, image_sizes, vision_feature_layer=None, "
        "vision_feature_select_strategy=None, vision_aspect_ratio=None, batch_num_images=None, **kwargs) -> "
        "BaseModelOutputWithPooling, pooler_output a list of one (n_tokens_i, hidden) tensor per image (newline "
        "tokens included)",
        language_model="model.model.language_model (Qwen2Model); vision tower model.model.vision_tower (SigLIP)",
        notes="learned model.model.image_newline vector appended per row (and once per image in multi-image). "
        "Without batch_num_images get_image_features treats every image as single (anyres), so the token counts "
        "only match when it is passed as the processor returns it.",
    ),
    "idefics3": dict(
        model_class="Idefics3ForConditionalGeneration",
        processor_class="Idefics3Processor",
        image_processor_class="Idefics3ImageProcessorPil",
        image_token="<image>",
        image_token_id=259,
        placeholder="<image>; the processor expands it to, per tile, '<fake_token_around_image><row_i_col_j>' + "
        "<image> * image_seq_len (a newline after each row), then '\\n<fake_token_around_image><global-img>' + "
        "<image> * image_seq_len + '<fake_token_around_image>'",
        image_tokens=20,
        image_tokens_40x56=20,
        image_tokens_rule="image_seq_len = (32 // 8) ** 2 // scale_factor**2 = 4 per tile; the image is resized to "
        "longest edge 64 and split into 32x32 tiles (2x2 here) plus a global 32x32 tile: 5 * 4 = 20",
        processor_outputs="input_ids, attention_mask, pixel_values ((batch, max_tiles, 3, 32, 32), all-zero padding "
        "tiles), pixel_attention_mask ((batch, max_tiles, 32, 32))",
        bidirectional_image_attention="no (causal language model; the vision tower is non-causal)",
        mrope="no: 1-D positions",
        get_image_features="model.model.get_image_features(pixel_values, pixel_attention_mask=None, **kwargs) -> "
        "BaseModelOutputWithPooling, pooler_output a list of one tensor per SAMPLE (all its images' tokens "
        "concatenated), not per image",
        language_model="model.model.text_model (LlamaModel; not language_model); vision model.model.vision_model",
        notes="the processor calls tokenizer.add_special_tokens in its __init__ (fake/image/end_of_utterance) and "
        "needs <global-img> and <row_i_col_j> (i, j <= 6) as tokens; pixel-shuffle connector (scale_factor 2). "
        "SmolVLM (same model family) is left out: SmolVLMProcessor requires the num2words package, not installed.",
    ),
    "internvl": dict(
        model_class="InternVLForConditionalGeneration",
        processor_class="InternVLProcessor (video_processor=None)",
        image_processor_class="GotOcr2ImageProcessorPil (crop_to_patches=True)",
        image_token="<IMG_CONTEXT>",
        image_token_id=261,
        placeholder="<IMG_CONTEXT> (template writes '<IMG_CONTEXT>\\n'); the processor expands it to '<img>' + "
        "<IMG_CONTEXT> * (image_seq_length * num_tiles) + '</img>'",
        image_tokens=20,
        image_tokens_40x56=12,
        image_tokens_rule="image_seq_length = 4 per 32x32 tile (4x4 patches, CLS dropped, pixel shuffle 0.5); "
        "tiles: the best grid of up to max_patches=4 tiles for the aspect ratio, plus a thumbnail when more than "
        "one (64x64: 2x2 + 1 = 5 tiles = 20; 40x56: 1x2 + 1 = 3 tiles = 12)",
        processor_outputs="input_ids, attention_mask, pixel_values ((total_tiles, 3, 32, 32), all images' tiles)",
        bidirectional_image_attention="no (causal)",
        mrope="no: 1-D positions",
        get_image_features="model.model.get_image_features(pixel_values, vision_feature_layer=None, "
        "vision_feature_select_strategy=None, **kwargs) -> InternVLVisionModelOutputWithPooling, pooler_output a "
        "(total_tiles, tokens_per_tile, hidden) tensor (not split per image)",
        language_model="model.model.language_model (Qwen2Model); vision tower model.model.vision_tower",
        notes="tie_word_embeddings True (the default; kept). The processor pads on the left (text_kwargs "
        "padding_side='left'); its image_token_ids (for mm_token_type_ids) include <img> and </img>.",
    ),
    "llava": dict(
        model_class="LlavaForConditionalGeneration",
        processor_class="LlavaProcessor",
        image_processor_class="LlavaImageProcessorPil",
        image_token="<image>",
        image_token_id=259,
        placeholder="<image> (the processor repeats it)",
        image_tokens=16,
        image_tokens_40x56=16,
        image_tokens_rule="(32 // 8) ** 2 patches + 1 CLS - 1 (vision_feature_select_strategy 'default' drops "
        "CLS): every image is resized (shortest edge 32) and center-cropped to 32x32",
        processor_outputs="input_ids, attention_mask, pixel_values ((num_images, 3, 32, 32))",
        bidirectional_image_attention="no (causal)",
        mrope="no: 1-D positions",
        get_image_features="model.model.get_image_features(pixel_values, vision_feature_layer=None, "
        "vision_feature_select_strategy=None, image_sizes=None, **kwargs) -> BaseModelOutputWithPooling, "
        "pooler_output a list of one (n_tokens, hidden) tensor per image",
        language_model="model.model.language_model (LlamaModel); vision tower model.model.vision_tower (CLIP)",
        notes="vision_feature_layer -2 (the second-to-last hidden state of the CLIP tower).",
    ),
}
