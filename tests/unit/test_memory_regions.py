"""What a release names, as the memory manager reads it."""

from services.memory_manager.service import regions_of


def test_a_release_names_a_region_its_parts_or_everything() -> None:
    regions = ["weights:a", "chat:kv", "chat-2:kv", "weights:ab"]
    assert regions_of("weights:a", regions) == ["weights:a"]
    assert regions_of("chat", regions) == ["chat:kv"]
    assert regions_of("*", regions) == regions
    assert regions_of("nothing", regions) == []
