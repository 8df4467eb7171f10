"""Model folders built for tests and benchmarks: built once, however many processes ask at once; and the
model ``flowkv demo`` and the ``bench`` subcommands run (``--model-dir``): a folder that holds a model is
used as it is, never rebuilt; one without gets the demo model."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from pathlib import Path

from vllm_helpers import tiny_model_dir

from flowkv._testing.tiny_model import build_folder
from flowkv.integration.harness import default_model_dir, model_folder


def test_concurrent_builders_of_one_folder_build_it_once(tmp_path):
    """Two builders at the same time (the test command's background build of the trained model and a
    test that needs it): the second waits for the first and returns its folder, it does not train again."""
    target = tmp_path / "models" / "model-x"
    builds: list[str] = []

    def build(staging: Path) -> None:
        builds.append(staging.name)
        time.sleep(0.5)  # long enough that the second builder arrives while the first is at work
        (staging / "weights").write_text("w")

    def complete(folder: Path) -> bool:
        return (folder / "weights").is_file()

    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(build_folder(target, complete, build)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.1)
    for thread in threads:
        thread.join()
    assert results == [target, target] and len(builds) == 1
    assert complete(target) and sorted(p.name for p in target.parent.iterdir()) == [".model-x.lock", "model-x"]


def test_a_builder_that_failed_leaves_nothing_and_the_next_one_builds(tmp_path):
    target = tmp_path / "model-y"

    def broken(staging: Path) -> None:
        (staging / "half").write_text("h")
        raise RuntimeError("out of disk")

    try:
        build_folder(target, lambda folder: (folder / "weights").is_file(), broken)
    except RuntimeError:
        pass
    assert not target.exists() and [p.name for p in tmp_path.iterdir()] == [".model-y.lock"]
    assert build_folder(target, lambda folder: (folder / "weights").is_file(),
                        lambda staging: (staging / "weights").write_text("w")) == target


def digests(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


def test_a_folder_holding_a_model_is_used_as_it_is(tmp_path):
    # A model of the user's (here the tests' tiny Llama, not the demo model's shape): not replaced.
    own = tmp_path / "my-model"
    shutil.copytree(tiny_model_dir(), own)
    before = digests(own)
    assert model_folder(own) == own
    assert model_folder(str(own)) == own
    assert digests(own) == before


def test_the_default_folder_is_the_demo_models(monkeypatch, tmp_path):
    monkeypatch.setenv("FLOWKV_CACHE", str(tmp_path / "cache"))
    assert default_model_dir() == tmp_path / "cache" / "models" / "demo-llama"
    # A model put in the default folder by hand is not the demo model's recipe: the demo model replaces it.
    shutil.copytree(tiny_model_dir(), default_model_dir())
    shutil.copytree(tiny_model_dir(), tmp_path / "empty-one")
    (tmp_path / "empty-one" / "config.json").unlink()
    built = model_folder(None)
    assert built == default_model_dir()
    assert json.loads((built / "config.json").read_text())["num_hidden_layers"] == 4  # DEMO_MODEL's
    # A folder without a model's config gets the demo model too.
    assert json.loads((model_folder(tmp_path / "empty-one") / "config.json").read_text())["num_hidden_layers"] == 4
