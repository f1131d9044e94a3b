"""Reading a load's pieces into its targets, the public reading core of the client that
`CheckpointClient.load` and the offline reader (ckptd.offline) share: `pieces` (where a
fragment's bytes are, `Source`/`Decoding`, and their verified range reads), `fill` (`Fill`,
`fill_all`: copies out of arenas, reads of files, resharding, dtype conversion), `decode`
(quantized and residual pieces). Arena mappings are ckptd.client.arenas."""
