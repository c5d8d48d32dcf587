"""What an operator sees when object storage cannot be used, through `manyfold store list --store s3://...` against
the S3 server on loopback: one line naming the URL and a non-zero exit for each way it fails (no credentials, a
bucket that does not exist, a denial, an endpoint that does not answer), and no request to the instance-metadata
service unless the operator allows it (MANYFOLD_S3_INSTANCE_METADATA=1; gs:// and az:// stores alike)."""

import os
import socket
import subprocess
import sys
import threading

import pytest

from loadtests.generator import free_port

CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_WEB_IDENTITY_TOKEN_FILE",
               "AWS_ROLE_ARN", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
               "AWS_SKIP_SIGNATURE")


class Listener:
    """A loopback socket the instance-metadata endpoint is pointed at (AWS_METADATA_ENDPOINT): it accepts every
    connection, counts it and closes it, so a client asking it fails at once rather than waiting."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.connections += 1
            conn.close()


@pytest.fixture
def metadata():
    listener = Listener()
    yield listener
    listener.sock.close()


def store_list(url: str, metadata: Listener, **env: str | None) -> subprocess.CompletedProcess:
    """`manyfold store list --store URL` with the loopback S3 server's environment changed by env (None: unset)."""
    run_env = {**os.environ, "AWS_METADATA_ENDPOINT": metadata.url}
    for k, v in env.items():
        run_env.pop(k, None) if v is None else run_env.__setitem__(k, v)
    return subprocess.run([sys.executable, "-m", "serve.cli", "store", "list", "--store", url], env=run_env,
                          capture_output=True, text=True, timeout=120)


def one_line(proc: subprocess.CompletedProcess, code: int, starts: str) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith(f"manyfold: error: {starts}") and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_no_credentials_is_one_line_naming_what_was_looked_for_and_asks_no_metadata_service(s3_bucket, metadata):
    proc = store_list(f"{s3_bucket}/store", metadata, **dict.fromkeys(CREDENTIALS))
    one_line(proc, 2, f"store {s3_bucket}/store: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; "
                      "AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN")
    assert "MANYFOLD_S3_INSTANCE_METADATA=1" in proc.stderr
    assert metadata.connections == 0
    allowed = store_list(f"{s3_bucket}/store", metadata, MANYFOLD_S3_INSTANCE_METADATA="1",
                         **dict.fromkeys(CREDENTIALS))
    assert allowed.returncode != 0 and allowed.stderr.count("\n") == 1, allowed.stderr  # still no credentials
    assert metadata.connections > 0  # asked, as allowed: the listener stands where the service would


@pytest.mark.parametrize("url,cloud,flag", [
    ("gs://manyfold-bucket/store", "GCS", "MANYFOLD_GCS_INSTANCE_METADATA"),
    ("az://manyfold-container/store", "Azure", "MANYFOLD_AZURE_INSTANCE_METADATA"),
])
def test_a_gcs_or_azure_store_without_credentials_is_refused_before_any_request(url, cloud, flag, metadata, tmp_path):
    """obstore's fallback for these is the cloud's own metadata service, at an address no loopback listener stands
    in for: the refusal comes before the store is opened, so nothing is asked at all."""
    unset = [k for k in os.environ if k.startswith(("GOOGLE_", "AZURE_"))]
    proc = store_list(url, metadata, HOME=str(tmp_path), **dict.fromkeys(unset))
    one_line(proc, 2, f"store {url}: no {cloud} credentials: set ")
    assert f"{flag}=1" in proc.stderr


def test_a_bucket_that_does_not_exist_is_one_line(s3_server, metadata):
    proc = store_list("s3://manyfold-no-such-bucket/store", metadata)
    one_line(proc, 1, "store s3://manyfold-no-such-bucket/store: the bucket does not exist")
    assert metadata.connections == 0


def test_a_denied_request_is_one_line(s3_bucket, metadata, monkeypatch):
    import moto.settings

    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto checks keys: ours are unknown
    proc = store_list(f"{s3_bucket}/store", metadata)
    one_line(proc, 1, f"store {s3_bucket}/store: access denied (InvalidAccessKeyId")
    assert metadata.connections == 0


def test_an_endpoint_that_does_not_answer_is_one_line_after_bounded_retries(s3_bucket, metadata):
    nobody = f"http://127.0.0.1:{free_port()}"
    proc = store_list(f"{s3_bucket}/store", metadata, AWS_ENDPOINT_URL=nobody)
    one_line(proc, 1, f"store {s3_bucket}/store: no answer from {nobody} within 10 s of retries")
    assert metadata.connections == 0
