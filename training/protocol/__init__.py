"""What islands and the syncer agree on: the pseudo-gradient sign, fragments and their schedule,
rounds, the claims a contribution makes and their bounds, and the update broadcast. The island
and the merge meet only here and in `training.store`."""
