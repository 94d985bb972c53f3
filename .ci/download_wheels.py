"""Download, for a machine without a package registry, the wheels fglit needs there beyond what its image has.

    python .ci/download_wheels.py DIR [--python-version 3.12] [--image-packages .ci/gpu_image_packages.txt] [--skip NAME ...]

Takes the exact versions of this checkout's working `.venv` (`pip freeze`), skips what the image already has
(torch, torch-geometric, numpy, ...; `--image-packages`, one name per line), the notebook server family (not nbformat: tests/test_docs.py writes notebooks with it) and Ray
(test-only or too large to carry), and downloads binary wheels for the target Python on manylinux x86-64.
`bash .ci/offline_venv.sh DIR` on the other machine then builds `.venv` from them.
"""
import argparse
import re
import subprocess
import sys
from pathlib import Path

SKIP = re.compile(r"^(torch|ray|uv|triton|nvidia-.*|fglit|pip|setuptools|wheel|jupyter(?!-core$).*|jupyterlab.*|notebook.*|nbclient|nbconvert|"
                  r"ipykernel|ipywidgets|widgetsnbextension|tornado|pyzmq|debugpy|terminado|send2trash|argon2-cffi.*|"
                  r"json5|bleach|tinycss2|mistune|pandocfilters|webencodings|"
                  r"defusedxml|babel|async-lru|overrides|notebook-shim|python-json-logger|rfc3339-validator|rfc3986-validator|"
                  r"rfc3987-syntax|webcolors|uri-template|isoduration|fqdn|arrow|types-python-dateutil|websocket-client|"
                  r"beautifulsoup4|soupsieve|platformdirs|comm|nest-asyncio|tzdata|sniffio|httpx|httpcore|h11|anyio)$")
OPENFGL = ["openfgl-lib==1.1.0", "munkres==3.0.0"]     # benchmarks/setup_openfgl.sh's OpenFGL, and the munkres it gets
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64", "manylinux1_x86_64", "any"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dest", type=Path)
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--image-packages", type=Path, default=Path(__file__).with_name("gpu_image_packages.txt"))
    ap.add_argument("--venv-python", default=".venv/bin/python")
    ap.add_argument("--keep", nargs="*", default=["grpcio", "protobuf"], help="download these even if the image has them (Flower's pins)")
    ap.add_argument("--skip", nargs="*", default=[], help="leave these out too (e.g. igraph texttable jedi: what travels to the GPU machine must fit in 64 MiB)")
    ap.add_argument("--openfgl", type=Path, default=None, metavar="DIR", help="also put OpenFGL 1.1.0 and munkres (what it needs beyond "
                    "fglit's venv and the image) in DIR, for the OpenFGL side-by-side on CUDA (.ci/gpu_session.sh installs them there)")
    o = ap.parse_args()
    image = {canonical(line.strip()) for line in o.image_packages.read_text().splitlines() if line.strip() and not line.startswith("#")}
    image -= {canonical(k) for k in o.keep}
    freeze = subprocess.run([o.venv_python, "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout.splitlines()
    pins = [line for line in freeze if "==" in line and not line.startswith("#")]
    skip = {canonical(k) for k in o.skip}
    wanted = [p for p in pins if canonical(p.split("==")[0]) not in image | skip and not SKIP.match(canonical(p.split("==")[0]))]
    plat = [arg for p in PLATFORMS for arg in ("--platform", p)]
    failed = []
    jobs = [(pin, o.dest) for pin in wanted] + ([(pin, o.openfgl) for pin in OPENFGL] if o.openfgl else [])
    for dest in {d for _, d in jobs} | {o.dest}:
        dest.mkdir(parents=True, exist_ok=True)
    for pin, dest in jobs:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "--python-version", o.python_version, "--implementation", "cp", *plat, "-d", str(dest), pin],
                           capture_output=True, text=True)
        (failed.append(pin) if r.returncode else None)
        print(("FAILED " if r.returncode else "ok     ") + pin, flush=True)
    print(f"{len(jobs) - len(failed)} of {len(jobs)} wheels in {o.dest}" + (f" and {o.openfgl}" if o.openfgl else "")
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
