"""GNNs: fanout neighbour sampling, the GAT encoder of HIIM, triple-classification pretraining."""
