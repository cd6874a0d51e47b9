"""devices.json (edgert profile's output): a round trip, and a clear error for each kind of bad file."""

import json

import pytest

from edgert.devices import BlockTiming, DeviceProfile, DevicesFile, LinkProfile, load_devices, save_devices
from edgert.errors import EdgertError, FileFormatError


def devices_file(**changes) -> DevicesFile:
    timing = BlockTiming(block="fc1", forward_ms=0.5, backward_ms=1.2, peak_bytes=4096, optimizer_ms=0.05)
    device = DeviceProfile(name="pi-1", url="coap+tcp://10.0.0.2:5701", memory_bytes=1 << 30, cores=4,
                           blocks=(timing,), whole=timing)
    fields = dict(model_sha256="ab" * 32, blocks=("fc1",), micro_batch=16, devices=(device,),
                  links=(LinkProfile(source="pi-1", target="pi-2", bandwidth_bytes_per_s=1e7, rtt_ms=2.5),),
                  memory_mode="stash")
    return DevicesFile(**{**fields, **changes})


def test_a_devices_file_reads_back_as_written(tmp_path):
    written = devices_file()
    read = load_devices(save_devices(written, tmp_path / "devices.json"))
    assert read == written
    assert read.device("pi-1").timing("fc1").backward_ms == 1.2
    assert read.link("pi-1", "pi-2").rtt_ms == 2.5 and read.link("pi-2", "pi-1") is None
    with pytest.raises(EdgertError, match="no device 'pi-9'; it has pi-1"):
        read.device("pi-9")


@pytest.mark.parametrize("change,message", [
    (lambda d: d.update(format="something-else"), "not an edgert devices file"),
    (lambda d: d.update(format_version=99), "version 99 is not supported"),
    (lambda d: d.update(memory_mode="swap"), "memory_mode must be one of recompute, stash, got 'swap'"),
    (lambda d: d.pop("micro_batch"), "devices.json: micro_batch: missing"),
    (lambda d: d["devices"][0].update(speed=3), r"devices\[0\]: unknown field 'speed' \(known: name, url, "),
    (lambda d: d.update(micro_batch="many"), "micro_batch: expected an integer, got 'many'"),
    (lambda d: d["devices"][0]["whole"].update(peak_bytes=-1), r"devices\[0\].whole.peak_bytes must be >= 0, got -1"),
    (lambda d: d["devices"][0].update(cores=2.5), r"devices\[0\].cores: expected an integer, got 2.5"),
    (lambda d: d["links"][0].update(rtt_ms=float("nan")), r"links\[0\].rtt_ms: expected a number, got nan"),
    (lambda d: d["links"][0].update(bandwidth_bytes_per_s=0), r"links\[0\].bandwidth_bytes_per_s must be > 0, got 0"),
    (lambda d: d["devices"][0].update(blocks={}), r"devices\[0\].blocks: expected a list, got \{\}"),
    (lambda d: d.update(devices=[]) or d.update(notes=[]), "notes: expected an object, got"),
    (lambda d: d["devices"][0].update(name=""), r"devices\[0\].name must not be empty"),
])
def test_a_bad_devices_file_is_named(tmp_path, change, message):
    data = devices_file().to_json()
    data = json.loads(json.dumps(data))
    change(data)
    path = tmp_path / "devices.json"
    path.write_text(json.dumps(data))
    with pytest.raises(FileFormatError, match=message):
        load_devices(path)


def test_a_missing_or_unparsable_file_is_named(tmp_path):
    with pytest.raises(EdgertError, match="no such devices file .*edgert profile"):
        load_devices(tmp_path / "absent.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(EdgertError, match="broken.json: not valid JSON"):
        load_devices(tmp_path / "broken.json")
    (tmp_path / "binary.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")  # a file that is not text at all
    with pytest.raises(FileFormatError, match="binary.json: not valid JSON"):
        load_devices(tmp_path / "binary.json")
