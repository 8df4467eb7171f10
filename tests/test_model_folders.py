"""Model folders built for tests and benchmarks: built once, however many processes ask at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from flowkv._testing.tiny_model import build_folder


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
