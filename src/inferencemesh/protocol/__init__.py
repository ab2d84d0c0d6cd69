"""Generated wire protocol modules (see stage.proto)."""
