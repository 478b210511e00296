"""Expert-parallel load balancing (seed steps 7, 53, 54): physical expert slots and their maps
(``placement``), DeepSeek's rebalancing algorithm (``rebalance``), the weight moves between
ranks (``mover``) and the per-worker state that counts heat and decides when to move
(``state``)."""
