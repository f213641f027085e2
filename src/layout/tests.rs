use super::*;

#[test]
fn tp4_pp2_mha_has_16_objects_summing_to_page_bytes() {
    let l = LayoutSpec::mha(32, 8, 128, 2, 16).with_parallel(4, 2).build().unwrap();
    assert_eq!(l.object_count(), 16);
    // 16 layers per stage * 16 tokens * 2 heads * 128 dim * 2 bytes
    assert_eq!(l.object_bytes(0), 16 * 16 * 2 * 128 * 2);
    let sum: u64 = (0..16).map(|i| l.object_bytes(i)).sum();
    assert_eq!(sum, l.page_bytes());
    // All heads of all layers, K and V: 32 * 16 * 8 * 128 * 2 * 2.
    assert_eq!(l.page_bytes(), 32 * 16 * 8 * 128 * 2 * 2);
    let mut seen = std::collections::HashSet::new();
    for (i, id) in l.objects().iter().enumerate() {
        assert_eq!(l.object_index(*id), Some(i));
        assert!(seen.insert(*id));
    }
}

#[test]
fn dtype_and_kv_order_are_identity() {
    let base = LayoutSpec::mha(4, 2, 64, 2, 32);
    let bf16 = base.clone().with_dtype(Dtype::Bf16).build().unwrap();
    let f16 = base.clone().with_dtype(Dtype::F16).build().unwrap();
    assert_ne!(bf16, f16);
    assert_eq!(bf16.page_bytes(), f16.page_bytes());
    assert_ne!(base.clone().build().unwrap(), f16);
    let hnd = base.clone().with_dtype(Dtype::F16).with_kv_order(KvOrder::PackedHnd);
    assert_ne!(hnd.clone().build().unwrap(), f16);
    assert!(hnd.describe().contains("packed-hnd") && hnd.describe().contains("f16"));
    assert_eq!(
        base.clone().with_dtype(Dtype::F32).build().unwrap_err(),
        LayoutError::DtypeBytes {
            dtype: "f32",
            want: 4,
            got: 2
        }
    );
    assert_eq!(
        LayoutSpec::mla(4, 576, 2, 32)
            .with_kv_order(KvOrder::PackedHnd)
            .build()
            .unwrap_err(),
        LayoutError::MlaPacked("packed-hnd")
    );
    for d in Dtype::ALL {
        assert_eq!(Dtype::from_code(d.code() as u32), Some(d));
    }
    for o in KvOrder::ALL {
        assert_eq!(KvOrder::from_code(o.code() as u32), Some(o));
    }
    assert_eq!(Dtype::from_code(7), None);
    assert_eq!(KvOrder::from_code(4), None);
}

#[test]
fn mla_at_tp8_has_one_object_per_stage() {
    let l = LayoutSpec::mla(60, 576, 2, 64).with_parallel(8, 1).build().unwrap();
    assert_eq!(l.object_count(), 1);
    assert_eq!(l.objects()[0].part, Part::Latent);
    let l2 = LayoutSpec::mla(61, 576, 2, 64)
        .with_parallel(8, 2)
        .with_pp_layers(vec![31, 30])
        .build()
        .unwrap();
    assert_eq!(l2.object_count(), 2);
    assert_eq!(l2.object_bytes(0), 31 * 64 * 576 * 2);
    assert_eq!(l2.object_bytes(1), 30 * 64 * 576 * 2);
    assert_eq!(l2.rank_objects(0, 1).unwrap(), vec![1]);
    assert!(l2.rank_objects(3, 1).unwrap().is_empty());
    // Every TP rank loads its stage's latent, though only rank 0 writes it.
    assert_eq!(l2.rank_load_objects(3, 1).unwrap(), vec![1]);
    assert_eq!(l2.rank_load_objects(0, 0).unwrap(), vec![0]);
    assert!(l2.rank_load_objects(8, 0).is_err());
    let mha = LayoutSpec::mha(4, 8, 128, 2, 16).with_parallel(2, 1).build().unwrap();
    assert_eq!(mha.rank_load_objects(1, 0).unwrap(), mha.rank_objects(1, 0).unwrap());
}

#[test]
fn tp_above_heads_replicates() {
    let l = LayoutSpec::mha(4, 2, 64, 2, 16).with_parallel(8, 1).build().unwrap();
    assert_eq!(l.heads_per_rank(), 1);
    assert_eq!(l.object_count(), 16);
    assert_eq!(
        LayoutSpec::mha(4, 3, 64, 2, 16).with_parallel(8, 1).build(),
        Err(LayoutError::HeadSplit {
            kv_heads: 3,
            tp_size: 8
        })
    );
}

#[test]
fn uneven_pipeline_must_be_explicit() {
    let spec = LayoutSpec::mha(61, 8, 128, 2, 16).with_parallel(1, 2);
    assert_eq!(
        spec.clone().build(),
        Err(LayoutError::UnevenPipeline { layers: 61, pp_size: 2 })
    );
    let l = spec.clone().with_pp_layers(vec![31, 30]).build().unwrap();
    assert_eq!(l.stage_layers(0), 31);
    assert!(l.object_bytes(0) > l.object_bytes(2));
    assert_eq!(
        spec.clone().with_pp_layers(vec![31, 31]).build(),
        Err(LayoutError::PipelineSum { sum: 62, layers: 61 })
    );
    assert_eq!(
        spec.with_pp_layers(vec![61]).build(),
        Err(LayoutError::PipelineStages { got: 1, pp_size: 2 })
    );
}

#[test]
fn zero_and_absurd_layouts_are_typed_errors() {
    assert_eq!(
        LayoutSpec::mha(0, 8, 128, 2, 16).build(),
        Err(LayoutError::Zero { field: "layers" })
    );
    assert_eq!(
        LayoutSpec::mha(32, 8, 128, 2, 16).with_parallel(1024, 4).build(),
        Err(LayoutError::TooManyObjects(8192))
    );
    assert!(matches!(
        LayoutSpec::mha(32, 8, 128, 2, 16).with_parallel(2048, 1).build(),
        Err(LayoutError::TooLarge { field: "tp_size", .. })
    ));
    assert!(matches!(
        LayoutSpec::mha(4000, 4000, 60000, 8, 1 << 20).build(),
        Err(LayoutError::TooLarge {
            field: "object_bytes",
            ..
        })
    ));
    assert_eq!(
        LayoutSpec::mla(8, 512, 2, 16)
            .with_parallel(1, 1)
            .build()
            .unwrap()
            .object_count(),
        1
    );
    let mut bad = LayoutSpec::mla(8, 512, 2, 16);
    bad.kv_heads = 4;
    assert_eq!(bad.build(), Err(LayoutError::MlaHeads(4)));
}
