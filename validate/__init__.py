"""The PyTorch executor of ``mpsim validate``, installed as the package ``mpsim.executor``
(run as ``torchrun ... -m mpsim.executor.executor``)."""
