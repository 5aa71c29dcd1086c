import dagster as dg


class TrainingResource(dg.ConfigurableResource):
    """How large the models are trained here: the profile (MEDGRAPH_PROFILE: tiny | demo | full) every training
    asset starts from. A run config's `profile` overrides it for one asset; any field set there wins over both."""

    profile: str = "demo"
