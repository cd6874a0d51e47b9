"""What a board's user meets before training: one onnxruntime, execution providers, and edgert doctor."""

import importlib.metadata

import pytest
from click.testing import CliRunner

from edgert.cli import main
from edgert.errors import MissingDependencyError, ProviderError
from edgert.ort_import import _check_one_distribution
from edgert.providers import check_available, parse_providers


def test_two_onnxruntime_distributions_are_refused_with_the_repair(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "packages_distributions",
                        lambda: {"onnxruntime": ["onnxruntime-training-cpu", "onnxruntime"]})
    with pytest.raises(MissingDependencyError) as error:
        _check_one_distribution()
    message = str(error.value)
    assert "onnxruntime and onnxruntime-training-cpu are all installed" in message
    assert "pip uninstall -y onnxruntime onnxruntime-training-cpu" in message
    assert "pip install 'edgert[board]'" in message and "pip install 'edgert[host]'" in message


def test_no_onnxruntime_says_which_extra_to_install(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {})
    with pytest.raises(MissingDependencyError, match=r"onnxruntime is not installed: pip install 'edgert\[board\]'"):
        _check_one_distribution()


def test_this_environment_has_exactly_one():
    _check_one_distribution()


@pytest.mark.parametrize("text,expected", [
    ("cpu", ("CPUExecutionProvider",)),
    ("cuda,cpu", ("CUDAExecutionProvider", "CPUExecutionProvider")),
    ("CUDA", ("CUDAExecutionProvider", "CPUExecutionProvider")),
    ("cpu,TensorrtExecutionProvider, cuda", ("TensorrtExecutionProvider", "CUDAExecutionProvider",
                                             "CPUExecutionProvider")),
])
def test_providers_are_named_best_first_with_the_cpu_last(text, expected):
    assert parse_providers(text) == expected


@pytest.mark.parametrize("text,message", [
    ("", "--providers is empty"),
    ("gpu", r"unknown execution provider\(s\) gpu: use one of"),
])
def test_bad_provider_lists_are_refused(text, message):
    with pytest.raises(ProviderError, match=message):
        parse_providers(text)


def test_a_provider_this_onnxruntime_lacks_is_refused_with_what_it_offers():
    assert check_available(("CPUExecutionProvider",)) == ("CPUExecutionProvider",)
    with pytest.raises(ProviderError, match=r"does not offer CUDAExecutionProvider; it offers .*CPUExecutionProvider"):
        check_available(parse_providers("cuda"))


def test_a_session_that_dropped_a_provider_is_refused():
    from edgert.providers import confirm_loaded

    class FellBackToCpu:  # what onnxruntime does when the CUDA libraries do not load
        def get_providers(self):
            return ["CPUExecutionProvider"]

    confirm_loaded(FellBackToCpu(), ("CPUExecutionProvider",), "backward.onnx")
    with pytest.raises(ProviderError, match="backward.onnx: onnxruntime could not load CUDAExecutionProvider"):
        confirm_loaded(FellBackToCpu(), ("CUDAExecutionProvider", "CPUExecutionProvider"), "backward.onnx")


def test_worker_refuses_a_missing_provider_in_one_line():
    result = CliRunner().invoke(main, ["worker", "--insecure", "--providers", "cuda,cpu"])
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "CUDAExecutionProvider" in errors[0]
    assert "Traceback" not in result.output


def test_doctor_trains_every_stage_of_a_plan(skip_model_path, tmp_path):
    from edgert.exporter.export import ExportOptions, export_plan

    export_plan(skip_model_path, tmp_path / "plan", ExportOptions(stages=2))
    result = CliRunner().invoke(main, ["doctor", "--plan", str(tmp_path / "plan"), "--port", "0",
                                       "--workdir", str(tmp_path / "work")])
    assert result.exit_code == 0, result.output
    for line in ("plan stage 0 (recompute)", "plan stage 0 (stash)", "plan stage 1 (recompute)", "onnxruntime"):
        assert line in result.output
    assert "plan stage 1 (stash)" not in result.output  # the last stage has nothing to stash
    assert "READY: 9 of 9 checks passed" in result.output


def test_doctor_reports_an_unusable_credential_and_fails(tmp_path):
    bad = tmp_path / "worker.pem"
    bad.write_text("not a credential")
    bad.chmod(0o600)
    result = CliRunner().invoke(main, ["doctor", "--credential", str(bad), "--port", "0"])
    assert result.exit_code == 1
    assert "credential" in result.output and "FAIL" in result.output and "not an edgert credential" in result.output
    assert "NOT READY" in result.output
