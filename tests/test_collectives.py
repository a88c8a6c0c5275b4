"""Counting collectives in HLO text: loops multiply, async and combined ops size correctly."""
from parallel.collectives import collective_stats

HLO = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ag = f32[64,4]{1,0} all-gather(%x), replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={0}
  %rs = f32[16]{0} reduce-scatter(%y), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}

%add (a: f32[], b: f32[]) -> f32[] {
  %s = f32[] add(%a, %b)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %ar = (f32[64]{0}, f32[32]{0}) all-reduce(%a, %b), replica_groups={}, to_apply=%add
  %ars = (f32[64]{0}, f32[32]{0}) all-reduce-start(%a, %b), replica_groups={}, to_apply=%add
  %ags = ((f32[128]{0}, f32[64]{0}), (f32[1024]{0}, f32[512]{0})) all-gather-start(%c, %d), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %rss = ((f32[1024]{0}), f32[128]{0}) reduce-scatter-start(%e), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %cp = (f32[256]{0}, f32[256]{0}, u32[], u32[]) collective-permute-start(%f), source_target_pairs={{0,1}}
}
"""


def test_loop_bodies_count_once_per_trip_and_ops_size_by_their_full_buffer():
  stats = collective_stats(HLO, num_devices=8)
  # 3 trips x one all-gather of 64x4 fp32, plus the async combined gather (results 1024 + 512).
  assert stats['all-gather'] == {'count': 4, 'bytes': 3 * 64 * 4 * 4 + (1024 + 512) * 4}
  # 3 trips x (16 x 8 devices) fp32, plus the async one sized by its operand.
  assert stats['reduce-scatter'] == {'count': 4, 'bytes': 3 * 16 * 8 * 4 + 1024 * 4}
  assert stats['all-reduce'] == {'count': 2, 'bytes': 2 * (64 + 32) * 4}
  assert stats['collective-permute'] == {'count': 1, 'bytes': 256 * 4}
  assert stats['all-to-all'] == {'count': 0, 'bytes': 0}


def test_sub_axis_and_device_id_spellings_of_replica_groups():
  line = ("ENTRY %m () -> f32[] {\n  %rs = f32[4]{0} reduce-scatter(%y), replica_groups=mesh['a'=2,"
          "'b'=4, device_ids=(0,1,2,3,4,5,6,7)] {'b':(1)2}, dimensions={0}\n}\n")
  assert collective_stats(line, num_devices=8)['reduce-scatter']['bytes'] == 4 * 4 * 2
