"""scripts/gpu/offline_wheels.sh install on a machine without bubblewrap: a carried bubblewrap .deb is unpacked
under $SITE (never into /), linked into $SITE/bin, and one line says whether it runs; without a .deb the line
says that coding rewards will refuse. A fake .deb (built with dpkg-deb) stands in for Debian's."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu" / "offline_wheels.sh"
pytestmark = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")


def _install(tmp_path, wheels):
    bin_ = tmp_path / "sysbin"  # a PATH with the tools the script needs and no bwrap
    bin_.mkdir(exist_ok=True)
    for tool in ("python3", "dpkg", "dpkg-deb", "sha256sum", "cut", "ls", "mkdir", "ln", "head", "tar", "sh", "bash",
                 "rm", "find", "touch"):
        if shutil.which(tool) and not (bin_ / tool).exists():
            (bin_ / tool).symlink_to(shutil.which(tool))
    env = dict(os.environ, PATH=str(bin_), SITE=str(tmp_path / "site"))
    r = subprocess.run(["bash", str(SCRIPT), "install", str(wheels)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_carried_bubblewrap_deb_is_unpacked_under_site_and_probed(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "DEBIAN" / "control").write_text("Package: bubblewrap\nVersion: 0.0-test\nArchitecture: all\n"
                                            "Maintainer: t <t@t>\nDescription: fake\n")
    (pkg / "usr" / "bin").mkdir(parents=True)
    (pkg / "usr" / "bin" / "bwrap").write_text("#!/bin/sh\nexit 0\n")  # a bwrap whose probe succeeds
    (pkg / "usr" / "bin" / "bwrap").chmod(0o755)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    subprocess.run(["dpkg-deb", "--build", str(pkg), str(wheels / "bubblewrap_0.0-test_all.deb")], check=True,
                   capture_output=True)
    out = _install(tmp_path, wheels)
    link = tmp_path / "site" / "bin" / "bwrap"
    assert link.is_symlink() and link.resolve() == (tmp_path / "site" / "deb" / "usr" / "bin" / "bwrap").resolve()
    assert f"bwrap: {link} runs" in out, out


def test_without_bubblewrap_the_install_says_coding_rewards_refuse(tmp_path):
    (tmp_path / "wheels").mkdir()
    out = _install(tmp_path, tmp_path / "wheels")
    assert "bwrap: missing does not run here" in out and "TRACE_SANDBOX_ALLOW_NO_BOUNDARY=1" in out, out
