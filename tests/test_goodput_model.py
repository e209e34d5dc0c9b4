"""The start-time model (ddpack/jobs/goodput_model.py) and the template's choice that follows it."""

from __future__ import annotations

import pytest

from ddpack.job_side import module
from ddpack.jobs.goodput_model import (
    Site,
    auto_stages,
    ddpack,
    main,
    read_and_unpack_shared,
    sbcast_levels,
    stage_by_sbcast,
    today,
    tree_depth,
)


def test_the_issue_arithmetic_128_nodes_reading_a_5_4_gb_image_from_a_1_2_gb_per_s_filesystem() -> None:
    """128 x 5.4 GB read at once from 1.2 GB/s of FSx is ~576 s: today's start is bound by that, ddpack's by one
    read and one local unpack; a failure costs today the queue plus a start, ddpack a new step and the trainer."""
    site = Site()
    assert read_and_unpack_shared(5400, 128, site) == pytest.approx(5400 * 128 / 1200)
    old, new = today(5400, 128, site), ddpack(5400, 128, site)
    assert new.path == "sbcast" and old.path == "shared"
    assert old.start_s > 9 * 60 and new.start_s < 60 and new.recovery_s == site.detect_s + site.step_s + site.trainer_s
    assert old.recovery_s == pytest.approx(site.detect_s + site.requeue_s + old.start_s)
    assert ddpack(5400, 128, site, held=True).start_s < new.start_s


def test_ddpack_starts_a_small_job_as_today_does_where_auto_keeps_the_shared_file() -> None:
    """Two nodes each get 600 MB/s of the 1,200 MB/s file system, more than they unpack: DDPACK_STAGE=auto reads
    the shared file, so ddpack's start is today's (issue 42: the table had 2 nodes paying for sbcast), and only a
    forced sbcast pays for the extra copy."""
    site = Site()
    small, forced = ddpack(5400, 2, site), ddpack(5400, 2, site, stage="sbcast")
    assert small.path == "shared" and small.start_s == today(5400, 2, site).start_s
    assert forced.path == "sbcast" and forced.start_s > small.start_s
    assert ddpack(5400, 2, site, stage="off", held=True).path == "shared"  # off never uses the nodes' copies
    assert [ddpack(5400, n, site).path for n in (2, 4, 5, 8, 128)] == ["shared", "shared", "sbcast", "sbcast", "sbcast"]


def test_sbcast_is_stop_and_wait_per_block_down_a_tree_whose_first_hop_is_the_fan_out_and_later_ones_tree_width() -> None:
    """Slurm 22.05's sbcast: each 8 MiB block is read, then sent down the whole tree, every reply back before the next
    block; the fan-out sets the first hop alone, TreeWidth (50) the later ones. A block costs the read, then at each level
    a hop plus the block to each child of the busiest sender over its one link. From 23.11 the fan-out sets every hop."""
    assert [sbcast_levels(n, 8, 50) for n in (2, 8, 9, 64, 1000)] == [[2], [8], [8, 1], [8, 7], [8, 50, 2]]
    assert sbcast_levels(64, 2, 50) == [2, 31] and sbcast_levels(1000, 16, 16) == [16, 16, 3]
    site = Site()
    per_block = 8 / site.fsx_mbps + 2 * site.sbcast_hop_ms / 1000 + (8 + 7) * 8 / site.node_mbps
    assert stage_by_sbcast(5400, 64, site) == pytest.approx(675 * per_block)
    assert stage_by_sbcast(5400, 1000, site) > stage_by_sbcast(5400, 64, site) > stage_by_sbcast(5400, 2, site)
    assert stage_by_sbcast(5400, 1000, Site(fanout=16, tree_width=16)) < stage_by_sbcast(5400, 1000, site)  # 23.11's tree
    slow = Site(sbcast_mbps=10)  # never less than the pipelined bound: size / rate plus a block a level
    assert stage_by_sbcast(5400, 64, slow) == pytest.approx(5400 / 10 + tree_depth(64, 8) * 8 / 10)


@pytest.mark.parametrize("rates", [(1200, 1000, 400), (300, 1000, 400), (5000, 800, 250), (1200, 100, 2000)])
def test_the_templates_auto_staging_follows_the_model(rates: tuple[int, int, int]) -> None:
    """DDPACK_STAGE=auto picks sbcast exactly where the model's start with sbcast beats every node reading the
    shared file (the tree's few blocks aside), for each node count up to 256; and the table's "ddpack (auto)"
    path is the template's own choice."""
    fsx, bcast, unpack = rates
    site = Site(fsx_mbps=fsx, sbcast_mbps=bcast, unpack_mbps=unpack)
    chosen = [module("ddpack_staging").stage_by_model(n, fsx, bcast, unpack) for n in range(1, 257)]
    for nodes, choice in enumerate(chosen, 1):
        shared = read_and_unpack_shared(5400, nodes, site)
        staged = 5400 / min(bcast, fsx) + 5400 / unpack
        assert choice == ("sbcast" if staged < shared else "off"), (nodes, choice, shared, staged)
        assert choice == ("sbcast" if auto_stages(nodes, site) else "off")
        assert ddpack(5400, nodes, site).path == ("sbcast" if choice == "sbcast" else "shared")


def test_the_model_prints_a_table_and_refuses_a_rate_of_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nodes", "2", "--nodes", "128", "--image-gb", "5.4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "ddpack (auto: path)" in out[0] and "sbcast" in out[0] and "held" in out[0]
    assert out[1].split()[:2] == ["5.4GB", "2"] and "(shared)" in out[1]
    assert out[2].split()[:2] == ["5.4GB", "128"] and "(sbcast)" in out[2]
    assert len(out) == 6  # the header, two rows, three lines of legend
    assert main(["--unpack-mbps", "0"]) == 2 and "--unpack-mbps must be above 0" in capsys.readouterr().err
