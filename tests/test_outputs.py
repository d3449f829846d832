"""The output types as a person reads them."""

from __future__ import annotations

from acb import RequestStatus


def test_a_request_status_prints_its_name():
    """``print(out.status)`` says ``CANCELLED``, not ``5`` (an ``IntEnum`` prints its number by
    default); the number is still ``int(status)``, and comparisons are unchanged."""
    s = RequestStatus.CANCELLED
    printf = "%s" % s  # noqa: UP031 (printf formatting is what is tested)
    assert (str(s), f"{s}", f"{s:>10}", printf, format(s)) == (
        "CANCELLED",
        "CANCELLED",
        " CANCELLED",
        "CANCELLED",
        "CANCELLED",
    )
    assert int(s) == 5 and s == 5 and s.is_terminal and repr(s) == "<RequestStatus.CANCELLED: 5>"


def test_a_finish_reason_and_a_failure_kind_print_their_value():
    """``print(out.status, out.finish_reason)`` says ``FINISHED length`` (the guides' comment), not
    ``FinishReason.LENGTH``; they stay ``str``s equal to their value (JSON, OpenAI's fields)."""
    import json

    from acb.outputs import FailureKind, FinishReason

    r = FinishReason.LENGTH
    printf = "%s" % r  # noqa: UP031 (printf formatting is what is tested)
    assert (str(r), f"{r}", f"{r:>8}", printf, json.dumps(r)) == (
        "length",
        "length",
        "  length",
        "length",
        '"length"',
    )
    assert r == "length" and repr(r) == "<FinishReason.LENGTH: 'length'>"
    assert f"{RequestStatus.FINISHED} {r}" == "FINISHED length"
    assert str(FailureKind.ENGINE_DEAD) == "engine_dead"
