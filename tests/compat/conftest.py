from tests.test_server import server  # noqa: F401  (the live Ray Serve fixture, shared with tests/test_server.py)
