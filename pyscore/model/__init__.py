"""The model side of the engine: config, loading, packing (query/items -> one token stream), the decoder."""
