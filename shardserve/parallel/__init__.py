"""Everything that talks over torch.distributed: process groups, parallel layers, pipeline stages,
expert dispatch, and the launcher that starts one process per rank."""
