//! Pitfall 1 (DEPENDENCIES.md, glommio #670) regression: after the seed, a new empty file
//! written and read back through DMA returns its bytes.

use glommio::io::OpenOptions;
use glommio::LocalExecutorBuilder;

/// Pitfall 1 regression test: after the seed, a brand-new empty file written and read
/// back through DMA returns the bytes (EOPNOTSUPP here means the work-around broke).
#[test]
fn dma_read_after_write_on_a_new_empty_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    LocalExecutorBuilder::default()
        .io_memory(1 << 20)
        .spawn(move || async move {
            felix_storage::seed_dma_probe(&d).await.unwrap();
            let p = d.join("segment-0");
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .dma_open(&p)
                .await
                .unwrap();
            let mut buf = f.alloc_dma_buffer(4096);
            buf.as_bytes_mut()
                .iter_mut()
                .enumerate()
                .for_each(|(i, b)| *b = (i % 251) as u8);
            assert_eq!(f.write_at(buf, 0).await.unwrap(), 4096);
            f.fdatasync().await.unwrap();
            let r = f
                .read_at_aligned(0, 4096)
                .await
                .expect("DMA read after write must work");
            assert_eq!(r.len(), 4096);
            assert!(r.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
            f.close().await.unwrap();
        })
        .unwrap()
        .join()
        .unwrap();
}
