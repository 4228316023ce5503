"""A model by Hugging Face id: read from a Hugging Face cache folder the test writes, offline, or
through a stand-in for the Hub's answer; never the network."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import calc
from calc.data.hub import from_pretrained, load_hub_config
from tests.hub_cache import TINY, write_snapshot

hub = pytest.importorskip("huggingface_hub")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)


def test_offline_reads_the_cache_and_says_so(tmp_path: Path, offline: None) -> None:
    path = write_snapshot(tmp_path, "Org/Tiny", TINY)
    got = load_hub_config("Org/Tiny", cache_dir=tmp_path)
    assert got.config == TINY
    assert got.path.resolve() == path.resolve()
    assert got.offline_reason is not None and "HF_HUB_OFFLINE" in got.offline_reason
    assert got.notice is not None and "Org/Tiny" in got.notice and "offline" in got.notice
    spec = from_pretrained("Org/Tiny", cache_dir=tmp_path)
    assert spec.name == "Org/Tiny"
    assert spec.n_params == 1352  # hand count in test_model_cards.test_tiny_llama_hand_count


def test_public_names(tmp_path: Path, offline: None) -> None:
    write_snapshot(tmp_path, "Org/Tiny", TINY)
    assert calc.from_pretrained("Org/Tiny", cache_dir=tmp_path).n_params == 1352
    assert isinstance(calc.load_hub_config("Org/Tiny", cache_dir=tmp_path), calc.HubConfig)


def test_offline_without_cache_is_one_clear_message(tmp_path: Path, offline: None) -> None:
    with pytest.raises(ValueError, match=r"Org/Missing.*HF_HUB_OFFLINE.*holds no config.json"):
        load_hub_config("Org/Missing", cache_dir=tmp_path)


def test_unreachable_hub_falls_back_to_the_cache(
    tmp_path: Path, online: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_snapshot(tmp_path, "Org/Tiny", TINY)

    def no_network(*args: object, **kwargs: object) -> None:
        raise ConnectionError("no route to host")

    monkeypatch.setattr(hub, "get_hf_file_metadata", no_network)
    got = load_hub_config("Org/Tiny", cache_dir=tmp_path)
    assert got.config == TINY
    assert got.offline_reason is not None and "could not be reached" in got.offline_reason
    with pytest.raises(ValueError, match=r"could not be reached.*holds no config.json"):
        load_hub_config("Org/Other", cache_dir=tmp_path)


def test_online_download_has_no_offline_notice(
    tmp_path: Path, online: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_snapshot(tmp_path, "Org/Tiny", TINY)
    calls: list[tuple] = []
    monkeypatch.setattr(hub, "get_hf_file_metadata", lambda url, **kw: calls.append((url,)))

    def download(repo_id: str, filename: str, **kw: object) -> str:
        calls.append((repo_id, filename, kw.get("local_files_only", False)))
        return str(path)

    monkeypatch.setattr(hub, "hf_hub_download", download)
    got = load_hub_config("Org/Tiny", cache_dir=tmp_path)
    assert got.offline_reason is None and got.notice is None
    assert ("Org/Tiny", "config.json", False) in calls  # only config.json, from the Hub


def _http_error(cls: type, status: int) -> Exception:
    httpx = pytest.importorskip("httpx2")
    request = httpx.Request("HEAD", "https://huggingface.co/Org/Nope/resolve/main/config.json")
    return cls("not there", response=httpx.Response(status, request=request))


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (
            lambda: _http_error(hub.errors.RepositoryNotFoundError, 404),
            "not a model on the Hugging",
        ),
        (lambda: _http_error(hub.errors.GatedRepoError, 403), "is gated"),
        (lambda: _http_error(hub.errors.RevisionNotFoundError, 404), "does not exist"),
        (lambda: _http_error(hub.errors.RemoteEntryNotFoundError, 404), "has no config.json"),
    ],
)
def test_hub_refusals_are_one_message(
    tmp_path: Path, online: None, monkeypatch: pytest.MonkeyPatch, error, message: str
) -> None:
    # Even with a cached copy: the Hub says the model (or file) is not there.
    write_snapshot(tmp_path, "Org/Nope", TINY)

    def refuse(*args: object, **kwargs: object) -> None:
        raise error()

    monkeypatch.setattr(hub, "get_hf_file_metadata", refuse)
    with pytest.raises(ValueError, match=message):
        load_hub_config("Org/Nope", cache_dir=tmp_path)


@pytest.mark.parametrize("bad", ["", "a/b/c", "../etc", "org/na--me", "org/-x", 7, "a b/c"])
def test_malformed_ids_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="Hugging Face id"):
        load_hub_config(bad)  # type: ignore[arg-type]


def test_bad_cached_files_are_one_message(tmp_path: Path, offline: None) -> None:
    write_snapshot(tmp_path, "Org/Broken", "{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        load_hub_config("Org/Broken", cache_dir=tmp_path)
    write_snapshot(tmp_path, "Org/List", "[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_hub_config("Org/List", cache_dir=tmp_path)


def test_without_huggingface_hub_one_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(ValueError, match=r"pip install 'vramplan\[hub\]'"):
        load_hub_config("Org/Tiny")


def test_calc_does_not_import_huggingface_hub() -> None:
    code = "import sys, calc; print('huggingface_hub' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
