"""planner/pricing.py: the prices file (flashflex.prices/1), validated on load; bad files and fleet options
are one line and exit 2 before any planning, with no file written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.errors import InputError
from flashflex_cli.hardware.cluster import save_cluster
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.planner.fleet.pricing import load_prices, per_million_tokens, prices_for

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "prices" / "example.json"
PLAN_ARGS = ["--model", "llama-tiny", "--global-batch", "8", "--seq-len", "64", "--dtype", "fp32"]


def _write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_the_bundled_example_loads_and_says_where_each_price_comes_from() -> None:
    prices, sha = load_prices(EXAMPLE)
    assert len(sha) == 64 and prices.currency == "USD" and "EXAMPLES" in prices.description
    for row in prices.prices:
        assert row.per_device_hour > 0 and row.provider and row.source.startswith("https://") and row.date
    cluster = build_cluster("1x8xA100-80G-SXM:nic=ib,1x4x4090:nic=eth")  # "4090" is an alias of RTX-4090
    table = prices_for(prices, cluster)
    assert table.per_device["node0/0"] == 5.12 and table.per_device["node1/3"] == 0.69
    assert table.cluster_hourly() == pytest.approx(8 * 5.12 + 4 * 0.69)
    assert table.hourly(["node0/0", "node1/0"]) == pytest.approx(5.12 + 0.69)


def test_dollars_per_million_tokens() -> None:
    # 36 $/h at 10,000 tokens/s: 36 / 3.6e7 tokens = 1e-6 $ per token = 1 $ per million tokens
    assert per_million_tokens(36.0, 10_000.0) == pytest.approx(1.0)
    assert per_million_tokens(1.0, 0.0) == float("inf")


def test_unknown_types_need_a_row_or_a_default(tmp_path: Path) -> None:
    data = build_cluster("1x2xcpu").model_dump(mode="json", by_alias=True)
    for device in data["nodes"][0]["devices"]:
        device["type"] = "my-accelerator"
    from flashflex_cli.hardware.cluster import Cluster

    cluster = Cluster.model_validate(data)
    path = _write(tmp_path / "p.json", {"schema": "flashflex.prices/1", "prices": [{"type": "T4", "per_device_hour": 1}]})
    prices, _ = load_prices(path)
    with pytest.raises(InputError, match=r"no price for device type 'my-accelerator' \(node node0\)"):
        prices_for(prices, cluster, str(path))
    path = _write(tmp_path / "q.json", {"schema": "flashflex.prices/1", "default_per_device_hour": 0.5,
                                        "prices": [{"type": "my-accelerator", "per_device_hour": 2.5}]})
    prices, _ = load_prices(path)
    assert prices_for(prices, cluster).cluster_hourly() == 5.0  # any type string may have its own row


BAD = {
    "negative": ({"schema": "flashflex.prices/1", "prices": [{"type": "cpu", "per_device_hour": -1}]},
                 "prices.0.per_device_hour"),
    "zero": ({"schema": "flashflex.prices/1", "prices": [{"type": "cpu", "per_device_hour": 0}]},
             "prices.0.per_device_hour"),
    "nan": ('{"schema": "flashflex.prices/1", "prices": [{"type": "cpu", "per_device_hour": NaN}]}',
            "prices.0.per_device_hour"),
    "infinite": ('{"schema": "flashflex.prices/1", "prices": [{"type": "cpu", "per_device_hour": Infinity}]}',
                 "prices.0.per_device_hour"),
    "text": ({"schema": "flashflex.prices/1", "prices": [{"type": "cpu", "per_device_hour": "cheap"}]},
             "prices.0.per_device_hour"),
    "huge": ({"schema": "flashflex.prices/1", "prices": [{"type": "cpu", "per_device_hour": 1e9}]},
             "prices.0.per_device_hour"),
    "schema": ({"schema": "flashflex.prices/2", "prices": [{"type": "cpu", "per_device_hour": 1}]}, "unknown schema"),
    "empty": ({"schema": "flashflex.prices/1", "prices": []}, "prices"),
    "twice": ({"schema": "flashflex.prices/1", "prices": [{"type": "RTX-4090", "per_device_hour": 1},
                                                         {"type": "4090", "per_device_hour": 2}]}, "priced twice"),
    "extra": ({"schema": "flashflex.prices/1", "prices": [{"type": "cpu", "per_device_hour": 1, "vat": 0.2}]},
              "prices.0.vat"),
    "missing": ({"schema": "flashflex.prices/1", "prices": [{"type": "T4", "per_device_hour": 1}]},
                "no price for device type 'cpu'"),
    "malformed": ('{"schema": "flashflex.prices/1", "prices": [', "malformed JSON"),
}


@pytest.fixture
def cluster_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.json"
    save_cluster(path, build_cluster("1x2xcpu,1x2xcpu"))
    return path


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_prices_file_is_one_line_and_exit_2_and_writes_nothing(case: str, cluster_file: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    data, needle = BAD[case]
    prices = _write(tmp_path / "prices.json", data)
    out = tmp_path / "plan.json"
    assert main(["plan", str(cluster_file), *PLAN_ARGS, "--prices", str(prices), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(("options", "needle"), [
    (["--objective", "cost"], "--objective cost needs --prices FILE"),
    (["--budget", "10"], "--budget needs --prices FILE"),
    (["--objective", "speed"], "--objective: unknown 'speed'"),
    (["--prices", "{prices}", "--budget", "-1"], "--budget must be positive"),
    (["--prices", "{prices}", "--budget", "nan"], "--budget must be a finite number"),
    (["--exclude", "node7"], "--exclude: unknown node 'node7'"),
    (["--exclude", "node0,node1"], "--exclude: leaves no node"),
    (["--exclude", ","], "--exclude: expected node names"),
])
def test_bad_fleet_options_are_one_line_and_exit_2(options: list[str], needle: str, cluster_file: Path,
                                                   tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prices = _write(tmp_path / "prices.json", {"schema": "flashflex.prices/1",
                                               "prices": [{"type": "cpu", "per_device_hour": 1}]})
    out = tmp_path / "plan.json"
    args = [o.replace("{prices}", str(prices)) for o in options]
    assert main(["plan", str(cluster_file), *PLAN_ARGS, *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err
    assert not out.exists()


def test_show_and_diff_refuse_prices_without_a_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    assert main(["show", str(plan), "--prices", str(EXAMPLE)]) == 2
    assert "--prices needs --cluster" in capsys.readouterr().err
    assert main(["diff", str(plan), str(plan), "--prices", str(EXAMPLE)]) == 2
    assert "need --cluster" in capsys.readouterr().err
