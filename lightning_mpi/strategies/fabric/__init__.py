"""Fabric's ``MPIStrategy`` (:mod:`.strategy`), with the parts that only it has: one optimizer step
with the rule (:mod:`.step`), the rule's state in ``fabric.save``/``fabric.load``
(:mod:`.checkpoints`) and the handover to a rank let in by ``heal="replace"`` (:mod:`.handover`)."""
