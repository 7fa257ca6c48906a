"""The run's rules: pure decisions, functions of the messages and the clock they are given.

Nothing under this folder reads a clock, a file or a socket, starts a thread or imports
asyncio (``tests/test_import_graph.py`` holds it); the service in ``../serve`` does all of that
around them."""
