"""plan.stages: the layouts, the ladder and its extras are all `ServingPlan`s, one per name."""

from qwen35_lib import plan as plan_lib


def test_one_plan_class_for_layouts_stages_and_the_cost_model():
    assert all(plan_lib.get_layout(n) is plan_lib.LAYOUT_PLANS[n] for n in plan_lib.LAYOUTS)
    assert all(type(s) is plan_lib.ServingPlan for s in (*plan_lib.STAGES.values(), *plan_lib.EXTRA.values()))
