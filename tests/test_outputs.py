"""The output types as a person reads them."""

from __future__ import annotations

from acb import RequestStatus


def test_a_request_status_prints_its_name():
    """``print(out.status)`` says ``CANCELLED``, not ``5`` (an ``IntEnum`` prints its number by
    default); the number is still ``int(status)``, and comparisons are unchanged."""
    s = RequestStatus.CANCELLED
    assert (str(s), f"{s}", f"{s:>10}", "%s" % s, format(s)) == ("CANCELLED", "CANCELLED", " CANCELLED",
                                                                "CANCELLED", "CANCELLED")
    assert int(s) == 5 and s == 5 and s.is_terminal and repr(s) == "<RequestStatus.CANCELLED: 5>"
