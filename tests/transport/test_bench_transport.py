"""The transport benchmark: figures computed from rows, the table, and one short real run via the CLI."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from edgert.bench.transport import format_table, parse_size, ratios
from edgert.cli import main
from edgert.transport.limits import KiB, MiB


def row(transport, size, ms, section="transport"):
    return {"section": section, "transport": transport, "bytes": size, "wire_bytes": size, "reps": 3,
            "rtt_ms_median": ms, "rtt_ms_p90": ms, "mb_per_s": size / ms / 1e3}


def test_ratios_are_time_ratios_of_the_same_bytes():
    rows = [row("raw-tcp", 4 * MiB, 10.0), row("coap+tcp", 4 * MiB, 8.0), row("coap-udp", 4 * MiB, 2000.0),
            row("coap+tcp", 4 * KiB, 0.4), row("single-message", 4 * MiB, 4.0, "strategy"),
            row("bert-1MiB", 4 * MiB, 8.0, "strategy"),
            {"section": "codec", "codec": "none", "ms": 0.3, "ratio": 1.0, "rel_rms": 0.0, "max_abs": 0.0},
            {"section": "codec", "codec": "int8_channel", "spec": "int8:axis=1", "ms": 4.0, "ratio": 3.99,
             "rel_rms": 0.004, "max_abs": 0.02}]
    figures = ratios(rows)
    assert figures["coap_tcp_vs_raw_4MiB"] == pytest.approx(1.25)
    assert figures["coap_udp_vs_raw_4MiB"] == pytest.approx(0.005)
    assert figures["rtt_4KiB_ms"] == 0.4 and figures["codec_ms_4MiB"] == 0.3
    assert figures["single_vs_bert_4MiB"] == pytest.approx(2.0)
    assert figures["int8_channel_ratio"] == 3.99 and figures["int8_channel_rel_rms"] == 0.004
    table = format_table({"rows": rows, "ratios": figures})
    assert "PASS  coap+tcp throughput / raw TCP, 4 MiB: 1.25" in table and "bert-1MiB" in table


def test_parse_size():
    assert [parse_size(s) for s in ("4K", "4KiB", "16M", "16MiB", "1048576")] == [4096, 4096, 16 * MiB,
                                                                                   16 * MiB, MiB]
    with pytest.raises(ValueError, match="must look like"):
        parse_size("lots")


@pytest.mark.timeout(180)
def test_cli_runs_the_benchmark_and_prints_json():
    result = CliRunner().invoke(main, ["bench", "transport", "--json", "--sizes", "4KiB,4MiB", "--udp-max", "4KiB",
                                       "--repeat", "0.1"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert set(data) == {"rows", "ratios"}
    for key in ("coap_tcp_vs_raw_4MiB", "coaps_tcp_vs_coap_tcp_4MiB", "raw_tls_vs_raw_tcp_4MiB",
                "oscore_udp_vs_coap_udp_4KiB", "rtt_4KiB_ms", "codec_ms_4MiB",
                "single_vs_bert_4MiB", "single_vs_chunked_4MiB", "fp16_ratio", "int8_ratio", "int8_channel_ratio",
                "int4_ratio", "topk_ratio", "topk_rel_rms", "int8_channel_rel_rms"):
        assert key in data["ratios"], key
    assert data["ratios"]["int8_channel_ratio"] >= 3.9 and data["ratios"]["int8_channel_rel_rms"] <= 0.01
    transports = {(r["transport"], r["bytes"]) for r in data["rows"] if r["section"] == "transport"}
    assert transports == {(name, size) for size in (4 * KiB, 4 * MiB)
                          for name in ("raw-tcp", "raw-tls", "coap+tcp", "coaps+tcp")} | \
        {("coap-udp", 4 * KiB), ("coap-udp+oscore", 4 * KiB)}


def test_options_come_from_the_config_and_bad_input_is_refused():
    help_text = subprocess.run([sys.executable, "-m", "edgert", "bench", "transport", "--help"],
                               capture_output=True, text=True, check=True).stdout
    assert "--json" in help_text and "--udp-max" in help_text and "4KiB,64KiB,1MiB,4MiB,16MiB" in help_text
    result = CliRunner().invoke(main, ["bench", "transport", "--sizes", "huge"])
    assert result.exit_code != 0 and "must look like" in result.output
    result = CliRunner().invoke(main, ["bench", "transport", "--repeat", "0"])
    assert result.exit_code == 2 and "--repeat must be > 0" in result.output
