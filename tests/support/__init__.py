"""What the tests share: ports, topics, Kafka reads, raw protocol frames, producer bindings
without Redis, proxies that can be killed, background load, a relay that cuts connections,
waiting on a condition, and where work handed to a worker thread runs. Test modules import
from here, never from each other; conftest.py files hold only fixtures."""
