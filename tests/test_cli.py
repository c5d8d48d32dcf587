import json
import subprocess
import sys

import pytest

from loadtests.generator import free_port
from serve.cli import main
from serve.store.tensors import SafetensorsSource, save_tensors
from tests.conftest import finetune_of, same_bits, tiny_state
from tests.store.test_store import model_dir


@pytest.fixture
def files(tmp_path, rng):
    base = tiny_state(rng)
    fine = finetune_of(base, rng)
    save_tensors(tmp_path / "base.safetensors", base)
    model_dir(tmp_path / "ft", fine)
    return tmp_path, fine


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_compress_then_decompress_is_bit_identical(files, capsys):
    d, fine = files
    code, out, _ = run(capsys, "fmdelta", "compress", "--base", str(d / "base.safetensors"),
                       "--finetuned", str(d / "ft"), "--out", str(d / "x.fmd"))
    assert code == 0 and "x.fmd" in out
    code, out, _ = run(capsys, "fmdelta", "decompress", "--base", str(d / "base.safetensors"),
                       "--delta", str(d / "x.fmd"), "--out", str(d / "f2.safetensors"))
    assert code == 0
    got = SafetensorsSource(d / "f2.safetensors")
    assert all(same_bits(got[k], fine[k]) for k in fine)


@pytest.mark.parametrize("case", ["missing", "truncated", "wrong_base", "shape_mismatch", "not_safetensors"])
def test_bad_input_is_one_line_and_nonzero(files, capsys, case, rng):
    d, _ = files
    run(capsys, "fmdelta", "compress", "--base", str(d / "base.safetensors"), "--finetuned", str(d / "ft"),
        "--out", str(d / "x.fmd"))
    base = str(d / "base.safetensors")
    delta = str(d / "x.fmd")
    if case == "missing":
        delta = str(d / "nope.fmd")
    elif case == "truncated":
        (d / "t.fmd").write_bytes((d / "x.fmd").read_bytes()[:100])
        delta = str(d / "t.fmd")
    elif case == "wrong_base":
        save_tensors(d / "other.safetensors", tiny_state(rng))
        base = str(d / "other.safetensors")
    elif case == "shape_mismatch":
        wrong = dict(SafetensorsSource(d / "base.safetensors"))
        wrong["layers.1.mlp.weight"] = wrong["layers.1.mlp.weight"][:, :4].contiguous()
        save_tensors(d / "other.safetensors", wrong)
        base = str(d / "other.safetensors")
    else:
        (d / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
        base = str(d / "junk.safetensors")
    code, _, err = run(capsys, "fmdelta", "decompress", "--base", base, "--delta", delta,
                       "--out", str(d / "out.safetensors"))
    assert code == 1
    assert err.startswith("manyfold: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not (d / "out.safetensors").exists()


def test_store_commands(files, capsys):
    d, _ = files
    model_dir(d / "basedir", dict(SafetensorsSource(d / "base.safetensors")))
    store = str(d / "store")
    assert run(capsys, "store", "add", "--store", store, "--kind", "base", "--name", "tiny",
               "--model", str(d / "basedir"))[0] == 0
    long_name = "a-fine-tune-named-past-twenty-four-characters"
    assert run(capsys, "store", "add", "--store", store, "--kind", "full", "--name", long_name, "--base", "tiny",
               "--model", str(d / "ft"))[0] == 0
    code, out, _ = run(capsys, "store", "list", "--store", store, "--json")
    assert code == 0 and {r["name"] for r in json.loads(out)} == {"tiny", long_name}
    code, out, _ = run(capsys, "store", "list", "--store", store)
    header, *rows = out.splitlines()
    kind = header.index("kind")  # every row's kind starts under its header, past the longest name
    assert code == 0 and len(rows) == 2 and all(r[kind - 2:kind] == "  " and r[kind] != " " for r in rows), out
    code, out, _ = run(capsys, "store", "verify", "--store", store)
    assert code == 0 and f"{long_name}: ok" in out
    code, _, err = run(capsys, "store", "remove", "--store", store, "tiny")
    assert code == 1 and "still has variants" in err


def test_console_script_exit_codes(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "serve.cli", "store", "list", "--store", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"manyfold: error: {tmp_path}: not a Manyfold store (no manifest.json)"
    proc = subprocess.run([sys.executable, "-m", "serve.cli", "fmdelta", "compress"], capture_output=True, text=True)
    assert proc.returncode == 2 and "required" in proc.stderr


def test_neuzip_compress_decompress_and_store_add(files, capsys):
    """An fp32 model directory: compress says it cast to bf16; decompress gives the bf16 weights exactly; a
    store base in NeuZip form keeps its bf16 weights beside the coded ones and verifies."""
    import torch

    d, _ = files
    weights = dict(SafetensorsSource(d / "base.safetensors"))
    model_dir(d / "basedir", weights)
    code, out, _ = run(capsys, "neuzip", "compress", "--model", str(d / "basedir"), "--bits", "7",
                       "--out", str(d / "nz"))
    assert code == 0 and "cast to bfloat16" in out and "4 weights coded (lossless)" in out
    assert (d / "nz" / "neuzip.nzp").is_file() and not (d / "nz" / "model.safetensors").exists()
    code, out, _ = run(capsys, "neuzip", "decompress", "--in", str(d / "nz"), "--out", str(d / "back"))
    assert code == 0
    back = SafetensorsSource(d / "back")
    assert all(same_bits(back[k], weights[k].to(torch.bfloat16)) for k in weights)
    code, _, err = run(capsys, "neuzip", "decompress", "--in", str(d / "nz"), "--out", str(d / "back"))
    assert code == 1 and "already exists" in err and err.count("\n") == 1

    store = str(d / "store")
    code, out, _ = run(capsys, "store", "add", "--store", store, "--kind", "base", "--name", "tiny",
                       "--model", str(d / "basedir"), "--neuzip-bits", "3")
    assert code == 0 and "3 mantissa bits kept" in out
    code, out, _ = run(capsys, "store", "verify", "--store", store)
    assert code == 0 and "tiny: ok" in out
    code, _, err = run(capsys, "store", "add", "--store", store, "--kind", "full", "--name", "ft", "--base", "tiny",
                       "--model", str(d / "ft"), "--neuzip-bits", "3")
    assert code == 2 and "--neuzip-bits is for --kind base" in err


def test_a_neuzip_lane_length_for_a_gpu_server_and_bad_ones(files, capsys):
    """--lane gpu writes shorter lanes that decode to the same weights; a lane length that cannot work is one line
    and writes nothing; --neuzip-lane without --neuzip-bits is refused."""
    import torch

    from serve.codecs import neuzip
    from serve.codecs.neuzip_file import NEUZIP_FILE, NzpFile

    d, _ = files
    weights = dict(SafetensorsSource(d / "base.safetensors"))
    model_dir(d / "basedir", weights)
    code, _, _ = run(capsys, "neuzip", "compress", "--model", str(d / "basedir"), "--out", str(d / "nz"),
                     "--lane", "gpu")
    assert code == 0 and NzpFile(d / "nz" / NEUZIP_FILE).header.lane == neuzip.LANE_GPU
    code, _, _ = run(capsys, "neuzip", "decompress", "--in", str(d / "nz"), "--out", str(d / "back"))
    back = SafetensorsSource(d / "back")
    assert code == 0 and all(same_bits(back[k], weights[k].to(torch.bfloat16)) for k in weights)
    for lane in ("0", "fast", str(neuzip.MAX_LANE + 1)):
        code, _, err = run(capsys, "neuzip", "compress", "--model", str(d / "basedir"), "--out", str(d / f"x{lane}"),
                           "--lane", lane)
        assert code == 2 and "NeuZip lane" in err and err.count("\n") == 1 and not (d / f"x{lane}").exists()
    store = str(d / "store")
    code, _, err = run(capsys, "store", "add", "--store", store, "--kind", "base", "--name", "tiny",
                       "--model", str(d / "basedir"), "--neuzip-lane", "gpu")
    assert code == 2 and "--neuzip-lane goes with --neuzip-bits" in err
    code, _, err = run(capsys, "store", "add", "--store", str(d / "new-store"), "--kind", "base", "--name", "tiny",
                       "--model", str(d / "basedir"), "--neuzip-bits", "7", "--neuzip-lane", "fast")
    assert code == 2 and "NeuZip lane" in err and not (d / "new-store").exists()  # refused before any store is made
    code, _, _ = run(capsys, "store", "add", "--store", store, "--kind", "base", "--name", "tiny",
                     "--model", str(d / "basedir"), "--neuzip-bits", "7", "--neuzip-lane", "64")
    nzp = next((d / "store").rglob(NEUZIP_FILE))
    assert code == 0 and NzpFile(nzp).header.lane == 64


@pytest.mark.parametrize("store", ["s3://bucket/store", "file:///srv/store", "gs://bucket/a/b"])
def test_serve_keeps_an_object_storage_url_as_given(tmp_path, store):
    """`manyfold serve --store s3://BUCKET/PREFIX` names the URL, not a path that folds s3:// into s3:/; with
    --config the flag still overrides the file's store."""
    from serve.cli import build_parser
    from serve.cli.server import _serve_config

    args = build_parser().parse_args(["serve", "--store", store])
    assert _serve_config(args, args.store).store == store
    config = tmp_path / "serve.yaml"
    config.write_text("store: /elsewhere\nport: 8123\n")
    args = build_parser().parse_args(["serve", "--store", store, "--config", str(config)])
    assert _serve_config(args, args.store).store == store


@pytest.fixture
def no_ray(monkeypatch):
    """Starting Ray (or joining a cluster) fails the test: the errors below come before it."""
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail(f"Ray started: init({a}, {k})"))


def test_serve_with_a_store_that_is_not_there_is_one_line_before_ray_starts(tmp_path, capsys, no_ray):
    code, out, err = run(capsys, "serve", "--store", str(tmp_path / "nowhere"), "--port", str(free_port()))
    assert code == 1 and err.startswith("manyfold: error: ") and err.count("\n") == 1, err
    assert "nowhere" in err


@pytest.mark.parametrize("form", ["{}", "ray://{}"])
def test_serve_onto_a_ray_cluster_that_does_not_answer_is_one_line_at_once(tmp_path, capsys, form, no_ray):
    """Ray itself waits minutes for an address nothing listens on, printing warnings every few seconds."""
    from serve.store.store import Store

    Store(tmp_path / "store", create=True)
    address = form.format(f"127.0.0.1:{free_port()}")
    code, _, err = run(capsys, "serve", "--store", str(tmp_path / "store"), "--ray-address", address)
    assert code == 2 and err.count("\n") == 1, err
    assert f"ray_address {address}: no Ray cluster answers at 127.0.0.1:" in err and "ray start --head" in err
