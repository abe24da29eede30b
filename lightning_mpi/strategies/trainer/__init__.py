"""The Trainer's ``MPIStrategy`` (:mod:`.strategy`), with the parts that only it has: how each stage
runs in this process (:mod:`.launch`), one optimizer step with the rule (:mod:`.step`) and the rule's
state in Lightning's checkpoints (:mod:`.checkpoints`)."""
