from policy.defrag import Neighbour, choose_preemption, relocatable


def test_only_lower_batch_neighbours_are_preempted_lowest_first() -> None:
    ns = [Neighbour("big", 9, 100, True), Neighbour("one", 1, 40, True), Neighbour("two", 2, 40, True)]
    p = choose_preemption(batch=5, need_bytes=60, neighbours=ns)
    assert p is not None and p.victims == ("one", "two")


def test_no_preemption_when_the_eligible_neighbours_cannot_free_enough() -> None:
    ns = [Neighbour("big", 9, 500, True), Neighbour("one", 1, 40, True)]
    assert choose_preemption(batch=5, need_bytes=60, neighbours=ns) is None


def test_a_neighbour_whose_requests_do_not_validate_elsewhere_is_not_taken() -> None:
    ns = [Neighbour("stuck", 1, 100, False), Neighbour("idle", 0, 30, False)]
    assert choose_preemption(batch=3, need_bytes=50, neighbours=ns) is None
    assert choose_preemption(batch=3, need_bytes=30, neighbours=ns).victims == ("idle",)


def test_only_instances_whose_requests_validate_on_another_node_are_relocatable() -> None:
    room = {("n1", "a"), ("n2", "b")}  # where each model would validate
    assert relocatable(["a", "b", "c"], ["n1", "n2"], lambda n, m: (n, m) in room) == ("a", "b")
    assert relocatable(["a"], [], lambda n, m: True) == ()  # no other node: nothing relocates
