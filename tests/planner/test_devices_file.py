"""devices.json (edgert profile's output): a round trip, and a clear error for each kind of bad file."""

import json

import pytest

from edgert.devices import BlockTiming, DeviceProfile, DevicesFile, LinkProfile, load_devices, save_devices
from edgert.errors import EdgertError


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
    (lambda d: d.update(memory_mode="swap"), "memory_mode 'swap' is not one of recompute, stash"),
    (lambda d: d.pop("micro_batch"), "malformed: KeyError: 'micro_batch'"),
    (lambda d: d["devices"][0].update(speed=3), "malformed: TypeError"),
    (lambda d: d.update(micro_batch="many"), "malformed: ValueError"),
])
def test_a_bad_devices_file_is_named(tmp_path, change, message):
    data = devices_file().to_json()
    data = json.loads(json.dumps(data))
    change(data)
    path = tmp_path / "devices.json"
    path.write_text(json.dumps(data))
    with pytest.raises(EdgertError, match=message):
        load_devices(path)


def test_a_missing_or_unparsable_file_is_named(tmp_path):
    with pytest.raises(EdgertError, match="no such devices file .*edgert profile"):
        load_devices(tmp_path / "absent.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(EdgertError, match="broken.json: not valid JSON"):
        load_devices(tmp_path / "broken.json")
