"""What the tests share: ports, topics, Kafka reads, raw protocol frames, proxies that can be
killed, background load, a relay that cuts connections, and waiting on a condition. Test
modules import from here, never from each other; conftest.py files hold only fixtures."""
