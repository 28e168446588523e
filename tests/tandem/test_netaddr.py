import pytest

from tandem.netaddr import is_wildcard, join_host_port, split_host_port


@pytest.mark.parametrize(
    ("text", "pair"),
    [("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:9000", ("::1", 9000)), ("localhost:1", ("localhost", 1))],
)
def test_round_trip(text, pair):
    assert split_host_port(text) == pair
    assert join_host_port(*pair) == text


@pytest.mark.parametrize("text", ["::1:80", "host", "[::1]80", ":80", "h:port", "h:70000"])
def test_bad_addresses(text):
    with pytest.raises(ValueError):
        split_host_port(text)


def test_wildcards():
    assert is_wildcard("0.0.0.0") and is_wildcard("::")
    assert not is_wildcard("127.0.0.1") and not is_wildcard("example.org")
