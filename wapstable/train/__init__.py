"""The training run, by concern: `step` (a batch's forward and loss); the loop and its events are in
`wapstable.trainer`."""
