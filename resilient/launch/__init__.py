"""The elastic half: the ``etcd-v3`` rendezvous, the ``resilient-run`` launcher, gang fencing.

Submodules are imported on use: workers only need :mod:`resilient.launch.gang`, which must
not pull in torch's elastic agent.
"""
