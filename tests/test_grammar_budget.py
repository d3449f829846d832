"""acb.grammar_budget: the static limits on a structured-outputs spec (issue 36: a 54-byte schema
``{"type": "string", "pattern": "a{1,30000}"}`` held a compile worker for over a minute). Plain
Python: no xgrammar needed."""

from __future__ import annotations

import pytest

import acb
from acb.grammar_budget import GrammarBudget, repetition
from acb.structured_outputs import StructuredOutputs


@pytest.mark.parametrize(
    "pattern, expanded",
    [
        ("abc", 0),
        (r"\d{3}-\d{4}", 7),
        (r"[a-z]{2,5}-\d{3}(\.[0-9]{1,4})?", 12),
        ("a{1,30000}", 30000),
        ("(a{1,100}){1,100}", 10100),  # nested counts multiply
        ("(?:ab){100}", 200),
        ("a{3,}", 3),
        ("a{,7}", 7),
        (r"\{a\}{5}", 5),  # an escaped brace is a character, its count applies to it
        ("[{]{5}", 5),  # a brace in a class is a member
        ("x{y}", 0),  # not a count: literal braces
        ("(ab|cd){10}", 40),  # alternatives are summed (an upper bound)
    ],
)
def test_repetition_of_regexes(pattern, expanded):
    assert repetition(pattern) == expanded


def test_repetition_of_ebnf_counts_literals_and_rule_names_whole():
    assert repetition('root ::= "ab"{1,100}', ebnf=True) == 200
    assert repetition('root ::= ("a"{1,1000}){1,1000}', ebnf=True) == 1_001_000
    assert repetition("root ::= item{2,3}\nitem ::= [a-z]", ebnf=True) == 3
    assert repetition('root ::= "{1,9999}"', ebnf=True) == 0  # inside a literal: text, not a count


def test_the_limit_stops_the_count_early():
    assert 10 < repetition("a{1,11}" + "b{1,1000}" * 1000, limit=10) < 1000 * 1000


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputs(json={"type": "string", "pattern": "a{1,30000}"}),  # the reported one
        StructuredOutputs(
            json={"type": "object", "properties": {"x": {"type": "string", "pattern": "(a{1,40}){1,40}"}}}
        ),
        StructuredOutputs(json={"type": "object", "patternProperties": {"^k{2000}$": {}}}),
        StructuredOutputs(
            json={
                "type": "object",
                "properties": {  # many small counts add up
                    f"p{i}": {"type": "string", "pattern": "[a-z]{1,100}"} for i in range(11)
                },
            }
        ),
        StructuredOutputs(regex="[a-z]{1,1001}"),
        StructuredOutputs(grammar='root ::= ("a"{1,100}){1,100}'),
    ],
)
def test_repetitions_over_the_limit_are_refused_naming_it(spec):
    with pytest.raises(
        ValueError,
        match=r"expand to more than 1000 characters, the limit "
        r"\(ContinuousBatchingConfig\.grammar_max_repetition\)",
    ):
        GrammarBudget().check(spec)


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputs(json={"type": "string", "pattern": "a{1,1000}"}),
        StructuredOutputs(json={"type": "string", "maxLength": 10**6, "minLength": 5}),  # lengths are not counts
        StructuredOutputs(json={"type": "array", "minItems": 10**5, "items": {"type": "integer"}}),
        StructuredOutputs(regex=r"\d{4}-\d{2}-\d{2}"),
        StructuredOutputs(choice=["a{1,99999}"]),  # a choice is text
        StructuredOutputs(json_object=True),
    ],
)
def test_ordinary_specs_pass(spec):
    GrammarBudget().check(spec)


def test_size_limit_names_the_field():
    big = StructuredOutputs(choice=[f"option number {i}" for i in range(10_000)])
    with pytest.raises(
        ValueError,
        match=r"choice constraint is \d+ bytes, more than the limit of 131072 "
        r"\(ContinuousBatchingConfig\.grammar_max_bytes\)",
    ):
        GrammarBudget().check(big)
    GrammarBudget(max_bytes=10**6).check(big)


def test_budget_from_config_and_its_validation():
    cfg = acb.ContinuousBatchingConfig(grammar_max_bytes=100, grammar_max_repetition=5, grammar_compile_timeout_s=2)
    assert GrammarBudget.from_config(cfg) == GrammarBudget(max_bytes=100, max_repetition=5, compile_timeout_s=2.0)
    assert GrammarBudget.from_config(acb.ContinuousBatchingConfig()) == GrammarBudget()
    for kwargs, message in [
        ({"grammar_max_bytes": 0}, "grammar_max_bytes"),
        ({"grammar_max_repetition": 1.5}, "grammar_max_repetition"),
        ({"grammar_compile_timeout_s": 0}, "grammar_compile_timeout_s"),
        ({"grammar_compile_timeout_s": float("inf")}, "grammar_compile_timeout_s"),
    ]:
        with pytest.raises(ValueError, match=message):
            acb.ContinuousBatchingConfig(**kwargs)
    with pytest.raises(ValueError, match="compile_timeout_s"):
        GrammarBudget(compile_timeout_s=-1)
    assert GrammarBudget(compile_timeout_s=None).compile_timeout_s is None  # a tensor-parallel follower's
