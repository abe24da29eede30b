"""The only place where Lightning meets a rule.

- :mod:`.core`: rule lifecycle and collectives over MPI, no Lightning;
- :mod:`.options`: each strategy's typed arguments, the same for every frontend;
- :mod:`.trainer`, :mod:`.decisions`, :mod:`.sharding`: the Trainer frontend;
- :mod:`.fabric`: the Fabric frontend;
- :mod:`.aids`: learning-rate scaling and momentum correction;
- :mod:`.environment`, :mod:`.checkpoint_io`: MPI ranks and atomic checkpoint files for Lightning;
- :mod:`.lightning_api`, :mod:`.build`, :mod:`.registry`: the classes built on the Lightning
  package the user imported, and the ``mpi_*`` names registered with it.
"""
