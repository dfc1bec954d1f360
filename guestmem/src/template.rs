//! Templates (RunD §4.3): a region's bytes saved to a file, and guest
//! memory restored as private copy-on-write mappings of such files.
//!
//! Why a restored sandbox can never see another tenant's bytes, nor leak its
//! own (docs/guestmem.md, "Templates"): the template is written from fresh
//! (kernel-zeroed) memory only; a restored region is a MAP_PRIVATE mapping of
//! the file opened read-only, so every write makes an anonymous page private
//! to that VMM; those pages go back to the kernel at munmap, never to the
//! pool (the region is not `pooled`), and nothing zeroes or recycles a page
//! of the file (every page is MAPPED, none DIRTY).

use crate::memory::GuestMemory;
use crate::region::Region;
use crate::table::table_size;
use crate::{sys, Error, RegionSpec};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// What `save_region` wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SavedRegion {
    /// Pages holding a non-zero byte (the rest are holes in the file).
    pub data_pages: u64,
    /// File length: guest bytes plus room for the page-state table.
    pub file_len: u64,
}

/// Writes the guest bytes of `region` to a new file at `path`, sparse (all-zero
/// pages are holes), followed by room for the page-state table that
/// `GuestMemory::from_template` formats in its private copy. The region must
/// hold no stale bytes of another tenant: callers save fresh memory only
/// (`pooled() == false`, checked here).
pub fn save_region(region: &Region, path: &Path) -> Result<SavedRegion, Error> {
    if region.pooled() {
        return Err(Error::InvalidSpec {
            region: region.name().to_string(),
            reason: "a template is saved from fresh memory only; this region came from the pool"
                .into(),
        });
    }
    let what = || {
        format!(
            "template file {} of region {:?}",
            path.display(),
            region.name()
        )
    };
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| Error::io(what(), e))?;
    let page = sys::base_page_size() as usize;
    let size = region.size() as usize;
    // SAFETY: the device view maps `size` guest bytes for as long as `region` lives;
    // the VM is paused, so nothing writes them while they are read.
    let bytes = unsafe { std::slice::from_raw_parts(region.device_view_ptr(), size) };
    let mut data_pages = 0;
    for (i, p) in bytes.chunks(page).enumerate() {
        if p.iter().any(|&b| b != 0) {
            f.write_all_at(p, (i * page) as u64)
                .map_err(|e| Error::io(what(), e))?;
            data_pages += 1;
        }
    }
    let file_len = region.size() + table_size(region.size(), sys::base_page_size());
    f.set_len(file_len).map_err(|e| Error::io(what(), e))?;
    f.sync_all().map_err(|e| Error::io(what(), e))?;
    Ok(SavedRegion {
        data_pages,
        file_len,
    })
}

/// One region of a template: its file mapped private copy-on-write.
fn open_template_region(spec: &RegionSpec, path: &Path) -> Result<Region, Error> {
    let f = File::open(path).map_err(|e| {
        Error::io(
            format!("template file {} of region {:?}", path.display(), spec.name),
            e,
        )
    })?;
    Region::from_template(spec, f)
}

impl GuestMemory {
    /// Guest memory restored from template files, one per region: each a
    /// private copy-on-write mapping (`Region::from_template`). No pool, no
    /// lazy zeroing, no DMA map: the bytes are the template's.
    pub fn from_template(regions: &[(RegionSpec, PathBuf)]) -> Result<GuestMemory, Error> {
        Self::from_template_with(regions, &[])
    }

    /// `from_template` plus `fresh` regions of this sandbox alone (a DMA
    /// window): new memfds, zero, DMA-mappable (`dma_map`, vanilla policy),
    /// so a device shares them while the template's memory stays private.
    pub fn from_template_with(
        regions: &[(RegionSpec, PathBuf)],
        fresh: &[RegionSpec],
    ) -> Result<GuestMemory, Error> {
        let all: Vec<RegionSpec> = regions
            .iter()
            .map(|(s, _)| s.clone())
            .chain(fresh.iter().cloned())
            .collect();
        crate::memory::validate(&all, sys::base_page_size())?;
        let mut out = Vec::with_capacity(all.len());
        for (spec, path) in regions {
            out.push(open_template_region(spec, path)?);
        }
        for spec in fresh {
            out.push(Region::fresh(spec, false)?);
        }
        GuestMemory::from_regions(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemoryPolicy, MemorySource};

    fn spec(size: u64) -> RegionSpec {
        RegionSpec {
            name: "ram".into(),
            gpa: 0,
            size,
            dma: false,
        }
    }

    fn digest(p: &Path) -> Vec<u8> {
        std::fs::read(p).unwrap()
    }

    #[test]
    fn restored_copies_are_private_and_the_template_never_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ram.mem");
        let size = 1 << 20;
        let src = GuestMemory::new(
            &[spec(size)],
            MemoryPolicy::Vanilla,
            MemorySource::Fresh,
            false,
        )
        .unwrap();
        src.write_instant(0x3000, b"template bytes").unwrap();
        let saved = save_region(src.region("ram").unwrap(), &path).unwrap();
        assert_eq!(saved.data_pages, 1, "only the written page is data");
        drop(src);
        let before = digest(&path);

        let regions = [(spec(size), path.clone())];
        let a = GuestMemory::from_template(&regions).unwrap();
        let b = GuestMemory::from_template(&regions).unwrap();
        let ra = a.region("ram").unwrap();
        assert!(ra.private() && !ra.pooled());
        assert_eq!(ra.guest_view_ptr(), ra.device_view_ptr(), "one mapping");
        // Sandbox A writes canaries over a template page and a hole.
        a.write_instant(0x3000, b"CANARY-A").unwrap();
        a.write_instant(0x8000, b"CANARY-A").unwrap();
        a.prepare_for_device_write(0x3000, 8).unwrap();
        let read = |m: &GuestMemory, gpa: usize, n: usize| {
            let r = m.region("ram").unwrap();
            // SAFETY: inside the region's mapping, which `m` keeps alive.
            unsafe { std::slice::from_raw_parts(r.guest_view_ptr().add(gpa), n) }.to_vec()
        };
        assert_eq!(read(&a, 0x3000, 14), b"CANARY-A bytes");
        assert_eq!(read(&b, 0x3000, 14), b"template bytes");
        assert_eq!(read(&b, 0x8000, 8), [0u8; 8]);
        // B cannot hand its memory to another process.
        assert!(matches!(b.memfd("ram"), Err(Error::PrivateRegion(_))));
        drop((a, b));
        assert_eq!(digest(&path), before, "the template file is unchanged");
        // A fresh restore sees the template, not A's canary.
        let c = GuestMemory::from_template(&regions).unwrap();
        assert_eq!(read(&c, 0x3000, 14), b"template bytes");
    }

    #[test]
    fn a_short_template_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ram.mem");
        std::fs::write(&path, b"short").unwrap();
        let err = GuestMemory::from_template(&[(spec(1 << 20), path)]).unwrap_err();
        assert!(err.to_string().contains("length 5"), "{err}");
    }
}
