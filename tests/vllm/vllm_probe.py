"""What tests/vllm/run_vllm.py runs on the model inside vLLM's worker (LLM.apply_model): importable
by name, since vLLM's engine process unpickles these functions by reference."""

def layer_methods(model):
    """Every MoE layer's method class, by layer name (runs in the worker)."""
    out = {}
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is not None and type(m).__name__ == "RoutedExperts":
            served = getattr(qm, "_mm", None) is not None
            out[name] = {"method": type(qm).__name__, "megamoe": served,
                         "layer_id": qm._mm.key if served else None}
    return out


def record_routing(model):
    """Wraps every MoE layer's method so that each call keeps its topk_ids (runs in the worker; eager
    mode, where the method's apply runs as Python on every forward). Keeps them on the model."""
    model._megamoe_routes, model._megamoe_io = [], {}
    for name, m in model.named_modules():
        if type(m).__name__ == "RoutedExperts":
            index = int(name.split(".layers.")[1].split(".")[0])
            apply = m.quant_method.apply

            def recording(layer, x, topk_weights, topk_ids, *args, _apply=apply, _index=index, **kwargs):
                model._megamoe_routes.append((_index, topk_ids.tolist()))
                y = _apply(layer, x, topk_weights, topk_ids, *args, **kwargs)
                if _index not in model._megamoe_io:  # each layer's first call: its inputs and output
                    model._megamoe_io[_index] = [t.float().tolist() for t in (x, topk_weights, topk_ids, y)]
                return y
            m.quant_method.apply = recording
    return True


def take_routes(model):
    routes, model._megamoe_routes = model._megamoe_routes, []
    return routes


def take_io(model):
    return model._megamoe_io
