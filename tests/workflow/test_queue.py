"""scripts/gpu/queue.sh: jobs run in order in the background, a failing or overlong job does not stop the queue,
`add` reaches a running queue, and `wait` packs the logs and the collected files into $OUT/queue.tgz."""
import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts/gpu/queue.sh"


def _q(tmp_path, *args):
    env = dict(os.environ, QDIR=str(tmp_path / "q"), OUT=str(tmp_path / "out"), COLLECT=str(tmp_path / "table.csv"),
               WHEELS=str(tmp_path / "no-wheels"), SITE=str(tmp_path / "site"))
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_queue_runs_every_job_and_packs_what_is_done(tmp_path):
    (tmp_path / "out").mkdir()
    jobs = tmp_path / "jobs"
    jobs.write_text(f"# a comment\n10 first echo one >> {tmp_path}/table.csv\n\n10 fails exit 3\n"
                    f"1 slow sleep 30\n10 waits sleep 2\n10 path echo $PYTHONPATH > {tmp_path}/path\n")
    assert _q(tmp_path, "start", str(jobs)).returncode == 0
    assert _q(tmp_path, "add", f"10 added echo two >> {tmp_path}/table.csv").returncode == 0
    r = _q(tmp_path, "wait", "40")
    assert r.returncode == 0, r.stderr
    done = [line.split()[:2] for line in (tmp_path / "q/jobs.txt").read_text().splitlines()]
    assert done == [["first", "0"], ["fails", "3"], ["slow", "124"], ["waits", "0"], ["path", "0"], ["added", "0"]]
    # the jobs' environment has the wheels' install folder (scripts/gpu/env.sh) and the root on PYTHONPATH
    assert (tmp_path / "path").read_text().split(":")[:2] == [str(ROOT), str(tmp_path / "site")]
    assert "finished" in r.stdout
    with tarfile.open(tmp_path / "out/queue.tgz") as t:
        names = t.getnames()
        assert "q/first.log" in names and "q/jobs.txt" in names
        assert t.extractfile("q/collect/table.csv").read().decode().split() == ["one", "two"]
