"""How the package's threads and processes run: an event loop in a daemon thread (`loop_thread`), the one-consumer
hand-off between them (`mailbox`), and pinning a process to CPUs (`affinity`).

May import: root.
"""
