"""Pure decisions: the save plan, the load plan, compression, retention, the files of a step, rollbacks."""
