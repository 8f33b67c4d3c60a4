"""defrag.units: parse_size accepts what users type and rejects the rest by name; format_bytes."""
import pytest

from defrag.units import format_bytes, parse_size

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize("value, expected", [
    (0, 0),
    (4096, 4096),
    (1 << 45, 1 << 45),
    ("4096", 4096),
    ("0", 0),
    ("8GiB", 8 * GiB),
    ("512MiB", 512 * MiB),
    ("64KiB", 64 * KiB),
    ("2TiB", 2 * TiB),
    ("1.5GB", 1_500_000_000),
    ("1.1GB", 1_100_000_000),
    ("2GB", 2_000_000_000),
    ("3k", 3000),
    ("10MB", 10_000_000),
    ("1.5KiB", 1536),
    ("0.5MiB", 512 * KiB),
    ("100b", 100),
    ("100B", 100),
    ("8gib", 8 * GiB),       # units are case-insensitive
    ("8 GiB", 8 * GiB),      # a space between number and unit
    ("  2MiB\n", 2 * MiB),   # surrounding whitespace, as from an env var or file
])
def test_parse_size_accepts(value, expected):
    result = parse_size(value)
    assert result == expected and type(result) is int


@pytest.mark.parametrize("value", [
    -1, -GiB, "-8GiB", True, False, None, 1.5, "", "   ", "8 parsecs", "GiB", "8GiBs",
    "8 Gi B", "1.5", "0.1KiB", "1e9", "0x100", "8,192", "½GiB", [8], b"8GiB",
])
def test_parse_size_rejects_with_the_value_named(value):
    with pytest.raises(ValueError) as info:
        parse_size(value)
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_parse_size_names_what_was_being_parsed():
    with pytest.raises(ValueError, match=r"^capacity .*'8 parsecs'"):
        parse_size("8 parsecs", what="capacity")
    with pytest.raises(ValueError, match=r"^DEFRAG_EMULATED_CAPACITY .*-5"):
        parse_size(-5, what="DEFRAG_EMULATED_CAPACITY")
    with pytest.raises(ValueError, match=r"^size "):
        parse_size(None)


def test_parse_size_keeps_large_integer_strings_exact():
    assert parse_size(str(2**64 + 1)) == 2**64 + 1


@pytest.mark.parametrize("n, text", [
    (0, "0 B"),
    (1, "1 B"),
    (1023, "1023 B"),
    (1024, "1.00 KiB"),
    (1536, "1.50 KiB"),
    (2 * MiB, "2.00 MiB"),
    (int(1.5 * GiB), "1.50 GiB"),
    (8 * GiB, "8.00 GiB"),
    (3 * TiB, "3.00 TiB"),
    (4096 * TiB, "4096.00 TiB"),   # TiB is the largest unit
    (-1536, "-1.50 KiB"),
    (-5, "-5 B"),
    (1536.0, "1.50 KiB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_format_bytes_round_trips_through_parse_size_for_exact_sizes():
    for n in (0, 512, 64 * KiB, 2 * MiB, 8 * GiB, 3 * TiB):
        assert parse_size(format_bytes(n).replace(" ", "")) == n
