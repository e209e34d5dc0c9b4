"""Hostlist and tasks-per-node parsing, checked against python-hostlist (an independent implementation)."""

from __future__ import annotations

import hostlist as reference
import pytest

from entrypoint.hostlist import HostlistError, expand_hostlist, expand_tasks_per_node

HOSTLISTS = [
    "node1",
    "ip-10-4-[33-35,40],gpu[01-02]",
    "rack[1-2]-node[01-02]",
    "gpu[008-011]",
    "n[8-10]",
    "a[1,3,5-6]b,c",
    "ip-10-0-0-[1-3]",
    "compute-dy-c5[1-2]",
    "x[0-0]",
    "h[09-11]",
]


@pytest.mark.parametrize("text", HOSTLISTS)
def test_expansion_matches_python_hostlist(text: str) -> None:
    assert expand_hostlist(text) == reference.expand_hostlist(text)


def test_zero_padding_and_order_are_kept() -> None:
    assert expand_hostlist("ip-10-4-[33-35,40],gpu[01-02]") == ["ip-10-4-33", "ip-10-4-34", "ip-10-4-35", "ip-10-4-40", "gpu01", "gpu02"]
    assert expand_hostlist("rack[1-2]-node[01-02]") == ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]
    assert expand_hostlist("gpu[008-011]")[0] == "gpu008"


@pytest.mark.parametrize("text", ["", "node[1-2", "node1-2]", "node[a-b]", "node[3-1]", "node[1-2],,x", "node[[1]]", "node[1-]", "no de"])
def test_malformed_hostlists_raise(text: str) -> None:
    with pytest.raises(HostlistError):
        expand_hostlist(text)


@pytest.mark.parametrize(
    ("spec", "counts"),
    [("4", [4]), ("4(x2),2", [4, 4, 2]), ("1(x3)", [1, 1, 1]), ("2,1(x2),3", [2, 1, 1, 3])],
)
def test_tasks_per_node(spec: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(spec) == counts


@pytest.mark.parametrize("spec", ["", "4(2)", "x2", "4(x)", "-1", "0", "2(x0)", "4(x2)2"])
def test_malformed_tasks_per_node_raise(spec: str) -> None:
    with pytest.raises(HostlistError):
        expand_tasks_per_node(spec)
