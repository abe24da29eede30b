"""The only place where Lightning meets a rule.

- :mod:`.trainer`, :mod:`.fabric`: one ``MPIStrategy`` per frontend (a package each, with the parts
  only that frontend has), defined once for every Lightning package, both holding one
  :class:`~.core.StrategyCore`; each lifecycle method calls a collaborator with one job:
  :mod:`.rule_runner`, :mod:`.replicas`, :mod:`.collectives`, :mod:`.failures`,
  :mod:`.convergence`, :mod:`.decisions`, :mod:`.preemption`, :mod:`.resume`, :mod:`.sharding`;
- :mod:`.common_options`: the options every strategy takes, defined once;
- :mod:`.signatures`: each strategy class's signature and docstring, made from those definitions
  and its rule's;
- :mod:`.environment`, :mod:`.checkpoint_io`: MPI ranks and atomic checkpoint files for Lightning;
- :mod:`.lightning_api`, :mod:`.build`, :mod:`.registry`: the classes built on the Lightning
  package the user imported, and the ``mpi_*`` names registered with it;
- :mod:`.reference`: the argument tables of ``docs/strategies.md``, made from the definitions.
"""
