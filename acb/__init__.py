"""acb: asyncio-native continuous batching for Hugging Face transformers causal LMs."""

from acb.api.async_engine import AsyncEngine
from acb.api.engine import Engine, generate_batch
from acb.api.handles import RequestHandle, SyncRequestHandle
from acb.api.manager import ContinuousBatchingManager, init_continuous_batching
from acb.config import ContinuousBatchingConfig
from acb.errors import (
    AcbError,
    EngineDeadError,
    EngineNotRunningError,
    InvalidRequestError,
    InvalidRequestTypeError,
    QueueFullError,
    RequestFailedError,
    UnsupportedModelError,
    WeightUpdateError,
)
from acb.outputs import (
    ContinuationScore,
    FailureKind,
    FinishReason,
    GenerationOutput,
    RequestStatus,
    ScoreOutput,
    StreamDelta,
)
from acb.sampling_params import SamplingParams
from acb.structured_outputs import StructuredOutputs
from acb.version import __version__ as __version__

__all__ = [
    "AcbError",
    "AsyncEngine",
    "ContinuationScore",
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "Engine",
    "EngineDeadError",
    "EngineNotRunningError",
    "FailureKind",
    "FinishReason",
    "GenerationOutput",
    "InvalidRequestError",
    "InvalidRequestTypeError",
    "QueueFullError",
    "RequestFailedError",
    "RequestHandle",
    "RequestStatus",
    "SamplingParams",
    "ScoreOutput",
    "StreamDelta",
    "StructuredOutputs",
    "SyncRequestHandle",
    "UnsupportedModelError",
    "WeightUpdateError",
    "generate_batch",
    "init_continuous_batching",
]
