//! Work-around for glommio's DMA read probe (DEPENDENCIES.md pitfall 1, upstream #670): the
//! first DMA open on a device probes polled reads, and on an empty file the probe wrongly
//! concludes reads are unsupported, after which every DMA read fails with EOPNOTSUPP. Each
//! executor therefore opens a non-empty 4096-byte seed file once at start, before any log
//! segment (which always starts empty) is opened.

use std::path::Path;

/// Write (if needed) and DMA-open `<dir>/.dma-seed` on the current executor.
pub async fn seed_dma_probe(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let seed = dir.join(".dma-seed");
    let ok = std::fs::metadata(&seed)
        .map(|m| m.len() >= 4096)
        .unwrap_or(false);
    if !ok {
        std::fs::write(&seed, vec![0x46u8; 4096])?;
    }
    let f = glommio::io::DmaFile::open(&seed)
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    f.close()
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
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
                super::seed_dma_probe(&d).await.unwrap();
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
}
