//! Frame codec of Felix protocol v1.
pub mod error;
pub use error::{ErrorCode, Retry};
