"""`manyfold bench objects`: the two object-storage libraries a store could stand on, obstore and fsspec's s3fs,
side by side against one S3-compatible server on loopback (moto's server mode; issue 35 asks for both measured
before one is chosen). Each operation is what a store does: put and get one large object (a base's weights),
put and get many small ones (adapters, manifests), and the put-if-absent a manifest generation needs. Medians of
`repeats`. s3fs is the bench extra's (`pip install -e '.[bench]'`); the server's own speed bounds both, so the
figures compare the libraries' overheads, not a cloud's bandwidth."""

import os
import uuid
from pathlib import Path

from serve.bench.report import NO_GPU, finish, machine, median_time

LARGE_MB = 64
SMALL = 200
SMALL_BYTES = 4096


def _obstore_ops(url: str, bucket: str, large: bytes, small: list[bytes], repeats: int) -> dict:
    import obstore
    from obstore.exceptions import AlreadyExistsError
    from obstore.store import S3Store

    st = S3Store(bucket, endpoint=url, client_options={"allow_http": True})
    obstore.put(st, "m", b"1")
    try:
        obstore.put(st, "m", b"2", mode="create")
        conditional = "not enforced"
    except AlreadyExistsError:
        conditional = "refused (AlreadyExistsError)"
    return {"put_large_s": median_time(lambda: obstore.put(st, "large", large), repeats),
            "get_large_s": median_time(lambda: obstore.get(st, "large").bytes(), repeats),
            "put_small_s": median_time(lambda: [obstore.put(st, f"s/{i}", d) for i, d in enumerate(small)], repeats),
            "get_small_s": median_time(lambda: [obstore.get(st, f"s/{i}").bytes() for i in range(len(small))], repeats),
            "put_if_absent_on_existing": conditional}


def _s3fs_ops(url: str, bucket: str, large: bytes, small: list[bytes], repeats: int) -> dict:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=url)
    fs.pipe_file(f"{bucket}/m", b"1")
    try:
        fs.pipe_file(f"{bucket}/m", b"2", IfNoneMatch="*")
        conditional = "not enforced"
    except FileExistsError:
        conditional = "refused (FileExistsError)"
    keys = [f"{bucket}/s/{i}" for i in range(len(small))]
    return {"put_large_s": median_time(lambda: fs.pipe_file(f"{bucket}/large", large), repeats),
            "get_large_s": median_time(lambda: fs.cat_file(f"{bucket}/large"), repeats),
            "put_small_s": median_time(lambda: fs.pipe(dict(zip(keys, small))), repeats),
            "get_small_s": median_time(lambda: fs.cat(keys), repeats),
            "put_if_absent_on_existing": conditional}


def run_objects_bench(out: Path, repeats: int = 3) -> dict:
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_REGION", "us-east-1")
    large = os.urandom(LARGE_MB << 20)
    small = [os.urandom(SMALL_BYTES) for _ in range(SMALL)]
    report = {"machine": machine(), "gpu": NO_GPU, "server": "moto (server mode) on 127.0.0.1", "repeats": repeats,
              "large_mb": LARGE_MB, "small": SMALL, "small_bytes": SMALL_BYTES, "libraries": {}}
    try:
        for name, ops in (("obstore", _obstore_ops), ("s3fs", _s3fs_ops)):
            bucket = f"bench-{name}-{uuid.uuid4().hex[:8]}"
            boto3.client("s3", endpoint_url=url).create_bucket(Bucket=bucket)
            report["libraries"][name] = ops(url, bucket, large, small, repeats)
    finally:
        server.stop()
    return finish(report, out, print_report)


def print_report(report: dict) -> None:
    print(f"object storage libraries against {report['server']}, median of {report['repeats']} ({report['machine']})")
    print(f"{'library':<10}{'put ' + str(report['large_mb']) + ' MB':>12}{'get':>8}"
          f"{'put ' + str(report['small']) + ' x 4 KB':>18}{'get':>8}  put-if-absent on an existing key")
    for name, r in report["libraries"].items():
        print(f"{name:<10}{r['put_large_s']:>11.3f}s{r['get_large_s']:>7.3f}s{r['put_small_s']:>17.3f}s"
              f"{r['get_small_s']:>7.3f}s  {r['put_if_absent_on_existing']}")
