"""`defrag run`'s summary line and `--report` (issue 46 items 10 and 18).

The report of a run that ran out of memory says what the refusal was, as it
was then: the request, live, stranded and reserved bytes, the capacity the
message advised, and the pool's stats at that moment (the rest of the report
is taken at exit). The summary line says what is stranded at exit in bytes,
with its share of the reserved bytes beside them.
"""

from __future__ import annotations

import pytest

from defrag.run import summary_line

BASE = {"exit_code": 0, "seconds": 0.1, "device": "emulated", "capacity_bytes": 1 << 30, "page_size_bytes": 2 << 20,
        "peak_live_bytes": 3 << 20, "peak_reserved_bytes": 6 << 20, "reserved_over_live": 2.0, "ooms": 0,
        "compactions": 0, "allocations": 20}


@pytest.mark.parametrize("stranded, reserved, shown", [
    (1258291, 4 << 20, "stranded at exit 1.20 MiB (30% of reserved)"),
    (0, 4 << 20, "stranded at exit 0 B"),
    (0, 0, "stranded at exit 0 B"),
    (16 << 10, 8 << 30, "stranded at exit 16.00 KiB (<1% of reserved)"),
])
def test_the_summary_says_what_is_stranded_at_exit_in_bytes_first(stranded, reserved, shown):
    """A small healthy run strands a large share of its few pages: the bytes come first, the share is named
    as a share of the reserved bytes, and the alarming word "fragmentation" is not used."""
    line = summary_line({**BASE, "stranded_at_exit_bytes": stranded, "reserved_at_exit_bytes": reserved,
                         "fragmentation_at_exit": stranded / reserved if reserved else 0.0})
    assert f" · {shown} · 0 OOMs · " in line, line
    assert "fragmentation" not in line
